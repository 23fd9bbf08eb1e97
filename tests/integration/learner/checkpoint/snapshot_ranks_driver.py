"""One DeepSpeed rank on the CPU (run directly with RANK=0 WORLD_SIZE=1 ...): checkpoint step 3 synchronously, then
as an asynchronous snapshot written by a background thread and renamed (test_async_checkpoint_ranks.py compares
the two), then snapshot again (``reuse.json``: how many of the weights' host copies the second snapshot reused). Arguments: model dir, output dir, deepspeed config, then ``lora`` or ``full``."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> int:
    import torch

    from streamgrpo.config import load_config
    from streamgrpo.learner.checkpoint.background import BackgroundWrite
    from streamgrpo.learner.trainer import Learner

    model_dir, out, ds_config, kind = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4]
    cfg = load_config("demo", [f"model.name_or_path={model_dir}", f"run_dir={out}", "learner.backend=deepspeed",
                               f"learner.deepspeed_config={ds_config}",
                               *(["model.lora={r: 4, alpha: 8}"] if kind == "lora" else [])])
    learner = Learner(cfg)
    learner.state.step = 3
    torch.manual_seed(5)
    learner.save(out / "sync")
    torch.manual_seed(5)
    snap = learner.snapshot(out / "async")
    BackgroundWrite(3, lambda: learner.write_snapshot(out / "async", snap)).result()
    learner.finalise_write(out / "async", 3)
    again = learner.snapshot(out / "again")  # the next checkpoint copies into the same host buffers
    same = [again.weights[n].data_ptr() == t.data_ptr() for n, t in snap.weights.items()]
    (out / "reuse.json").write_text(json.dumps({"weights": len(same), "reused": sum(same)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
