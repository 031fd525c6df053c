#!/usr/bin/env bash
# Soak test (not run in CI): the launcher under MINUTES of locust load (gRPC and HTTP streams) plus
# clients that leave their streams early at random; prints the failures, what the server still holds
# once the load is over (leaked generator slots and KV pages, vocoder streams, tts requests), and the RSS of
# tritonserver and its stubs at the start and the end. Exits 1 on a failure or a leak.
#
#   loadtest/soak.sh [--preset small|tiny | --checkpoint DIR] [--minutes 10] [--users 16] [--cancellers 2]
#                    [--attacks SECONDS] [--rss-every 30] [--rss-from SECONDS] [-- more launcher options]
# --attacks: a second process replays the open-door attacks (loadtest/attacks.py, the gateway's included)
# every SECONDS meanwhile, from 127.0.0.2 (a client apart from the load's). The gate (admission places and
# generator slots held) must be 0 at the end, and the supervisor must have logged no incident (a restart
# hides its failures behind a recovered gate).
# --rss-every: loadtest/rss_sampler.py writes each process's RSS (tritonserver, each stub by model, the
# gateway, the launcher) and the Python backend's /dev/shm regions to rss.csv every SECONDS, and prints a
# table (start / 25 % / 50 % / 75 % / end) at the end. --rss-from: that table's start, SECONDS after ready
# (default a quarter of the soak, at most 300 s: the first minutes are warm-up, docs/benchmarks.md); the
# sample at ready stays in the table, with the change from it. Beside it, how many generator pipes tts and
# ensemble_generator rotated: each holds a pipe's responses until it rotates (docs/triton.md, T25).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
preset=small checkpoint="" minutes=10 users=16 cancellers=2 attacks=0 rss_every=30 rss_from=
while [ $# -gt 0 ]; do
    case $1 in
        --preset) preset=$2; shift 2 ;;
        --checkpoint) checkpoint=$2; shift 2 ;;
        --minutes) minutes=$2; shift 2 ;;
        --users) users=$2; shift 2 ;;
        --cancellers) cancellers=$2; shift 2 ;;
        --attacks) attacks=$2; shift 2 ;;
        --rss-every) rss_every=$2; shift 2 ;;
        --rss-from) rss_from=$2; shift 2 ;;
        --) shift; break ;;
        *) sed -n '2,17p' "$0"; exit 2 ;;
    esac
done
[ -n "$rss_from" ] || rss_from=$(( minutes * 15 < 300 ? minutes * 15 : 300 ))
out=$(mktemp -d "${TMPDIR:-/tmp}/soak.XXXXXX")
if [ -z "$checkpoint" ]; then
    checkpoint=$($PY -c "import sys; from engine.random_checkpoint import cached_checkpoint; from engine.config import cache_dir
print(cached_checkpoint(sys.argv[1], cache_dir() / 'checkpoints' / f'{sys.argv[1]}-seed0'))" "$preset")
fi
read -r http grpc metrics openai < <($PY -c "from serving.supervision.triton_env import Ports, free_port
p = Ports.free(); print(p.http, p.grpc, p.metrics, free_port())")

$PY -m serving.serve --checkpoint "$checkpoint" --http-port "$http" --grpc-port "$grpc" --metrics-port "$metrics" \
    --openai-port "$openai" --work-dir "$out/runs" "$@" >"$out/launcher.log" 2>&1 &
launcher=$!
sampler=""
trap 'kill -TERM $launcher $sampler 2>/dev/null || true; wait $launcher || true' EXIT
echo "soak: $checkpoint, $minutes min, $users users + $cancellers cancelling clients; files in $out"
for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$http/v2/health/ready" && break
    kill -0 $launcher 2>/dev/null || { cat "$out/launcher.log"; exit 1; }
    sleep 0.5
done

rss() {  # MB of tritonserver and its stubs
    local server
    server=$(pgrep -P $launcher -x tritonserver)
    ps -o rss= -p "$(echo "$server" $(pgrep -P "$server") | tr ' ' ',')" | awk '{kb += $1} END {printf "%.0f MB", kb / 1024}'
}
gauges() {
    curl -s "http://127.0.0.1:$metrics/metrics" |
        grep -E '^tts_(generator_active_slots|vocoder_active_streams|requests_in_flight|ensemble_requests_in_flight|kv_pages_in_use|generator_waiting_for_kv|generator_held_responses) ' || true
}
echo "ready at $(date +%T); RSS at start: $(rss)"
$PY -m loadtest.rss_sampler sample --launcher $launcher --csv "$out/rss.csv" --every "$rss_every" &
sampler=$!

# clients that leave each stream after 1..6 chunks (the server must free its slot and vocoder state)
$PY - "$grpc" "$minutes" "$cancellers" >"$out/cancellers.log" 2>&1 <<'EOF' &
import random, sys, threading, time
from client import TTSClient

grpc, seconds, n = sys.argv[1], float(sys.argv[2]) * 60, int(sys.argv[3])
end, counts, lock = time.monotonic() + seconds, {"left": 0, "errors": 0}, threading.Lock()

def leave_early(seed):
    rng, tts = random.Random(seed), TTSClient(f"127.0.0.1:{grpc}", timeout=60)
    while time.monotonic() < end:
        try:
            for i, _ in enumerate(tts.stream("A stream its client leaves early.", seed=rng.randrange(1000),
                                             parameters={"max_patches": 48, "chunk_first": 1, "chunk_next": 2})):
                if i >= rng.randint(0, 5):
                    break
            outcome = "left"
        except Exception as e:
            print(f"error: {type(e).__name__}: {e}", flush=True)
            outcome = "errors"
            time.sleep(1)
        with lock:
            counts[outcome] += 1

threads = [threading.Thread(target=leave_early, args=(i,)) for i in range(n)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(f"cancelling clients: {counts['left']} streams left early, {counts['errors']} errors")
EOF
cancellers_pid=$!
attacks_pid=""
if [ "$attacks" != 0 ]; then
    # from 127.0.0.2: a client of its own, as the attacker would be (the server shares its bounds per client)
    $PY -m loadtest.attacks --url "127.0.0.1:$grpc" --gateway "http://127.0.0.1:$openai" --minutes "$minutes" \
        --every "$attacks" --source 127.0.0.2 >"$out/attacks.log" 2>&1 &
    attacks_pid=$!
fi

# every failure with its message (locust's CSV misses those of the final drain)
cat >"$out/failures.py" <<'EOF'
import os
from locust import events

@events.request.add_listener
def record(request_type, name, exception=None, **_):
    if exception is not None:
        with open(os.environ["SOAK_FAILURES"], "a") as f:
            f.write(f"{request_type} {name}: {type(exception).__name__}: {exception}\n")
EOF
SOAK_FAILURES=$out/failures.txt TTS_GRPC_HOST=127.0.0.1:$grpc TTS_HTTP_HOST=http://127.0.0.1:$http \
    $PY -m locust -f "loadtest/locustfile.py,$out/failures.py" --headless -u "$users" -r "$users" -t "${minutes}m" \
    --stop-timeout 60 --json --skip-log GrpcStreamUser HttpStreamUser >"$out/locust.json" 2>"$out/locust.log" || true
wait $cancellers_pid || true
[ -z "$attacks_pid" ] || wait $attacks_pid || true
sleep 3  # cancelled streams are freed within a generator step; give the vocoder a moment too

$PY -c "import json, sys
for s in json.load(open(sys.argv[1])):
    print(f\"{s['method']:4} {s['name']:11} {s['num_requests']:6} requests, {s['num_failures']} failures\")" "$out/locust.json"
if [ -s "$out/failures.txt" ]; then sort "$out/failures.txt" | uniq -c | sort -rn | head -20; fi
tail -1 "$out/cancellers.log"
if [ -n "$attacks_pid" ]; then  # what the attacks were answered, by attack
    echo "attacks: $(grep -c '^\[attacks\]' "$out/attacks.log") replayed"
    sed -n 's/^\[attacks\] \([a-z_]*\) ([^)]*): /\1: /p' "$out/attacks.log" | sort | uniq -c | sort -rn | head -16
fi
grep '^error: ' "$out/cancellers.log" | sort | uniq -c | sort -rn | head -5 || true
echo "RSS at end: $(rss)"
kill -TERM $sampler 2>/dev/null || true
wait $sampler || true
$PY -m loadtest.rss_sampler report "$out/rss.csv" --from "$rss_from" || true
# tts and ensemble_generator hold every response of a generator pipe until it is rotated (docs/triton.md#T25):
# their memory is judged over a soak that rotated each a few times
for model in tts ensemble_generator; do
    echo "  $model: $(cat "$out"/runs/*/tritonserver.log | grep -c "^\[$model\] INFO pipe .* new streams go on a new pipe") pipes rotated"
done
echo "after the load:"
gauges | sed 's/^/  /'
# read receipts (docs/triton.md#T23): responses the generator held for their reader, and how long in all
curl -s "http://127.0.0.1:$metrics/metrics" | grep -E '^tts_generator_held_(responses_total|seconds_total) ' | sed 's/^/  /' || true
gate() {  # admission places and generator slots held now (serving.flow.admission), from the run folder
    $PY -c "import sys; from pathlib import Path; from serving.flow.admission import Admission
gate = Admission(next(Path(sys.argv[1]).glob('*/cancel')), None, 1, create=False)
print(gate.total(), gate.slots_held())" "$out/runs"
}
read -r places slots_held < <(gate)
echo "  gate: $places admission places held, $slots_held generator slots held"
# the longest interval between two heartbeats of each stub (serving.supervision.run_folder.Beats; restarted stubs too)
$PY -c "import sys; from pathlib import Path; from serving.supervision.run_folder import longest_beat
for f in sorted(Path(sys.argv[1]).glob('*/heartbeat/*')):
    seconds, at = longest_beat(f) or (0.0, '-')
    print(f'  longest heartbeat interval: {f.name}: {seconds:.2f} s (ended {at})')" "$out/runs"
for f in "$out"/runs/*/stacks/*; do  # a heartbeat 2 s late dumps the stub's stacks there
    [ -s "$f" ] && echo "  late-heartbeat stacks: $f ($(grep -c '^Timeout' "$f") dumps)"
done
echo "  load average: $(cut -d' ' -f1-3 /proc/loadavg)"
grep -h '\[supervisor\]' "$out/launcher.log" | grep -v 'ready in' || true  # incidents, if any
failures=$($PY -c "import json, sys; print(sum(s['num_failures'] for s in json.load(open(sys.argv[1]))))" "$out/locust.json")
leaks=$(gauges | awk '$2 != 0' | wc -l)
cancel_errors=$(grep -c '^error: ' "$out/cancellers.log" || true)
incidents=$(grep -h '\[supervisor\]' "$out/launcher.log" | grep -vc 'ready in' || true)  # a restart is a failure
[ "$failures" = 0 ] && [ "$leaks" = 0 ] && [ "$cancel_errors" = 0 ] && [ "$places" = 0 ] && [ "$slots_held" = 0 ] \
    && [ "$incidents" = 0 ]
