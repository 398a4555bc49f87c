#!/bin/bash
# pause_watch.sh OUT SID: appends "start end" (epoch seconds) to OUT for each stretch during which a process
# of session SID was stopped (SIGSTOP, e.g. by another user's quiet script pausing python and llama
# processes for a run of theirs), polling every 0.2 s, until killed. agent_turns.py --pauses starts it and
# takes those stretches out of the TTFTs it measured. (A shell loop: quiet scripts stop python, not bash.)
out=$1 sid=$2 since=""
while true; do
  if ps -s "$sid" -o stat= | grep -q '^T'; then
    [ -z "$since" ] && since=$(date +%s.%N)
  elif [ -n "$since" ]; then
    echo "$since $(date +%s.%N)" >> "$out"
    since=""
  fi
  sleep 0.2
done
