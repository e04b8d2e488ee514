#!/bin/sh
# Any program as an agent: one rollout of examples/command_agent.py's task, in POSIX sh with curl and jq.
#
# aglverl runs it once per rollout attempt with the rollout's endpoints in the variables SDKs read
# (OPENAI_BASE_URL, OPENAI_API_KEY; also ANTHROPIC_BASE_URL / ANTHROPIC_API_KEY and Agent Lightning's AGL_*),
# the task's fields in the variables aglverl.processes.env_map names (TASK_PROMPT, TASK_WORD here; the whole
# input is on stdin and in $AGL_INPUT_FILE too). It asks the model, scores the answer (the share of its words
# that are the task's word) and writes the score to $AGL_REWARD_FILE (POSTing Agent Lightning's reward event to
# $AGL_EVENT_URL would do too). A non-zero exit, or no reward, fails the attempt; its output is in the rollout's
# log file. Every process a rollout starts is CPU its training step waits for: one curl, one jq (~25 ms of CPU
# at its start), a sed and a tr.
#
# A busy proxy turns a conversation's first call away with a 429 and Retry-After (its overload protection; the
# OpenAI and Anthropic SDKs wait and retry): `--retry` does the same here (curl retries 408, 429 and 5xx, after
# Retry-After when given). Without it such an attempt fails and is retried as a whole: wasted agent work.
set -eu

prompt=$(printf '%s' "$TASK_PROMPT" | sed 's/[\\"]/\\&/g' | tr '\n\t' '  ')     # as a JSON string's content
answer=$(curl -sS --fail --retry 5 "$OPENAI_BASE_URL/chat/completions" \
    -H "Authorization: Bearer $OPENAI_API_KEY" -H "Content-Type: application/json" \
    -d "{\"model\": \"any\", \"messages\": [{\"role\": \"user\", \"content\": \"$prompt\"}]}")
reward=$(printf '%s' "$answer" | jq -r --arg word "$TASK_WORD" '
    (.choices[0].message.content // "" | ascii_downcase | [scan("[a-z0-9'"'"']+")]) as $words
    | if ($words | length) == 0 then 0 else ([$words[] | select(. == $word)] | length) / ($words | length) end')

printf '%s\n' "$reward" > "$AGL_REWARD_FILE"
echo "reward $reward"
