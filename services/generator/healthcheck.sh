#!/usr/bin/env bash
# Container healthcheck: exit 0 iff GET http://127.0.0.1:$METRICS_PORT/healthz answers 200.
# (Every streamgrpo process serves /healthz next to /metrics on metrics.port; 503 = unhealthy.)
set -u
exec python3 - "${METRICS_PORT:-9100}" <<'PY'
import sys
import urllib.error
import urllib.request

url = f"http://127.0.0.1:{sys.argv[1]}/healthz"
try:
    with urllib.request.urlopen(url, timeout=4) as r:
        sys.exit(0 if r.status == 200 else 1)
except urllib.error.HTTPError as exc:
    print(f"healthcheck: {url} answered {exc.code}: {exc.read()[:200]!r}", file=sys.stderr)
except OSError as exc:
    print(f"healthcheck: {url}: {exc}", file=sys.stderr)
sys.exit(1)
PY
