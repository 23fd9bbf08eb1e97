"""The packed vision attention on CUDA (streamgrpo/models/vision_attention.py): sdpa picks other kernels there
(flash for equal windows, no mask; memory-efficient with the key mask), so the per-chunk equality is checked
on the device too, in float32 and bfloat16, with ragged windows and images of two sizes; skipped without CUDA."""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_packed_vision_features_match_the_per_chunk_path_on_cuda(tiny_any_dir, dtype, atol):
    from streamgrpo.models.vision_attention import install
    from tests.unit.models.test_logprobs import _load

    model = copy.deepcopy(_load(tiny_any_dir)[1]).to("cuda", dtype).eval()
    c = model.config.vision_config
    visual = model.model.visual
    grid = torch.tensor([[4, 6, 6], [1, 4, 4], [1, 6, 10]], device="cuda")  # ragged windows, two image sizes
    g = torch.Generator(device="cuda").manual_seed(0)
    pixels = torch.randn(int(grid.prod(1).sum()), c.in_channels * c.temporal_patch_size * c.patch_size**2,
                         device="cuda", generator=g).to(dtype)

    def features():
        out = visual(pixels, grid_thw=grid)
        return getattr(out, "pooler_output", out).float()

    with torch.no_grad():
        want = features()
        install(model)
        got = features()
    torch.testing.assert_close(got, want, atol=atol, rtol=0)
