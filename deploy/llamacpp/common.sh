# Shared by the llama.cpp benchmark scripts (sourced, not run): the engine binary and model,
# `warmroute` on $PYTHON, free ports, readiness waits, and stopping what the script started.
# The sourcing script sets PYTHON and defines log() first.

BIN=$(deploy/llamacpp/build.sh)
MODEL=$("$PYTHON" deploy/llamacpp/make_model.py)
warmroute() { "$PYTHON" -m proxy "$@"; }

free_port() { "$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

wait_http() {  # url pid: until it answers 200, or the process died, or 60 s passed
  local url=$1 pid=$2
  for _ in $(seq 600); do
    curl -fsS -o /dev/null "$url" 2>/dev/null && return 0
    kill -0 "$pid" 2>/dev/null || { log "process $pid exited before $url was ready"; return 1; }
    sleep 0.1
  done
  log "timed out waiting for $url"
  return 1
}

PIDS=()
stop_all() {  # only the processes this script started, by pid
  local pid
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  PIDS=()
}
trap stop_all EXIT INT TERM
