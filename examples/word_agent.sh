#!/bin/sh
# Any program as an agent: one rollout of examples/command_agent.py's task, in POSIX sh with curl and jq.
#
# aglverl runs it once per rollout attempt with the rollout's endpoints in the variables SDKs read
# (OPENAI_BASE_URL, OPENAI_API_KEY; also ANTHROPIC_BASE_URL / ANTHROPIC_API_KEY and Agent Lightning's AGL_*),
# the task input as JSON on stdin (and in the file $AGL_INPUT_FILE). It asks the model, scores the answer (the
# share of its words that are the task's word) and reports the score as Agent Lightning's reward event (writing
# it to $AGL_REWARD_FILE would do too). A non-zero exit, or no reward, fails the attempt; its output is in the
# rollout's log file. Two jq and two curl in all: each process a rollout starts is CPU its step waits for.
set -eu

request=$(jq -c '{model: "any", messages: [{role: "user", content: .prompt}]}')     # from the task, on stdin
answer=$(curl -sS --fail-with-body "$OPENAI_BASE_URL/chat/completions" \
    -H "Authorization: Bearer $OPENAI_API_KEY" -H "Content-Type: application/json" -d "$request")
reward=$(printf '%s' "$answer" | jq -r --slurpfile task "$AGL_INPUT_FILE" '
    (.choices[0].message.content // "" | ascii_downcase | [scan("[a-z0-9'"'"']+")]) as $words
    | if ($words | length) == 0 then 0 else ([$words[] | select(. == $task[0].word)] | length) / ($words | length) end')

curl -sS --fail-with-body "$AGL_EVENT_URL" -H "Authorization: Bearer $AGL_KEY" \
    -H "Content-Type: application/json" -d "{\"event_type\": \"reward\", \"data\": {\"value\": $reward}}" >/dev/null
echo "reward $reward"
