#!/bin/sh
# Any program as an agent: one rollout of examples/command_agent.py's task, in POSIX sh with curl and jq.
#
# aglverl runs it once per rollout attempt with the rollout's endpoints in the variables SDKs read
# (OPENAI_BASE_URL, OPENAI_API_KEY; also ANTHROPIC_BASE_URL / ANTHROPIC_API_KEY and Agent Lightning's AGL_*),
# the task input as JSON on stdin (and in the file $AGL_INPUT_FILE). It asks the model, scores the answer
# and reports the score as Agent Lightning's reward event (writing it to $AGL_REWARD_FILE would do too).
# A non-zero exit, or no reward, fails the attempt; its output is in the rollout's log file.
set -eu

task=$(cat)                                   # the task input, from stdin
prompt=$(printf '%s' "$task" | jq -r .prompt)
word=$(printf '%s' "$task" | jq -r .word)

request=$(jq -n --arg p "$prompt" '{model: "any", messages: [{role: "user", content: $p}]}')
answer=$(curl -sS --fail-with-body "$OPENAI_BASE_URL/chat/completions" \
    -H "Authorization: Bearer $OPENAI_API_KEY" -H "Content-Type: application/json" -d "$request" \
    | jq -r '.choices[0].message.content // ""')

# the share of the answer's words that are the word
reward=$(printf '%s\n' "$answer" | tr 'A-Z' 'a-z' | tr -cs "a-z0-9'" '\n' \
    | awk -v w="$word" 'NF { n++; if ($0 == w) k++ } END { printf "%.4f", (n ? k / n : 0) }')

curl -sS --fail-with-body "$AGL_EVENT_URL" -H "Authorization: Bearer $AGL_KEY" \
    -H "Content-Type: application/json" -d "{\"event_type\": \"reward\", \"data\": {\"value\": $reward}}" >/dev/null
echo "answer: $answer -> reward $reward"
