-- Multi-turn agents for wrk, driven by benchmarks/proxy_overload.py (--generator wrk).
--
-- Run as: wrk -t N -c N -d Ts --timeout 60s -s overload_agents.lua http://proxy -- TURNS THINK_MS PREFIX BODIES
-- One wrk thread is one agent on one keep-alive connection (so that a thread's Lua state knows which call each
-- answer is for): it talks in conversations of TURNS calls on one rollout attempt's path
-- (/rollout/PREFIX-<agent>-<n>/attempt/a/v1/chat/completions, its history re-sent as text: line k of the file
-- BODIES is turn k's body), THINK_MS (U(0.5, 1.5) times) between calls. A 429 is waited out (its
-- retry-after-ms) and the same call sent again, as the SDKs do; a 429 to a later turn (a conversation refused
-- mid-way) is counted apart. Any other status, or a connection that broke under a call, loses the
-- conversation (counted). At the end, every agent's counts and latencies go to the JSON file named by the
-- environment's AGL_BENCH_OUT (the main Lua state, which writes it, never sees the arguments). The proxy's token,
-- when it has one, is in the environment too: AGL_BENCH_TOKEN.

local ffi = require("ffi")
ffi.cdef [[
typedef struct { long tv_sec; long tv_nsec; } bench_timespec;
int clock_gettime(int clk_id, bench_timespec *tp);
]]
local clock = ffi.new("bench_timespec")

local function now_ms()
   ffi.C.clock_gettime(1, clock) -- CLOCK_MONOTONIC
   return tonumber(clock.tv_sec) * 1000 + tonumber(clock.tv_nsec) / 1e6
end

-- the main state: the agents, to read their counts at the end
local agents = {}

function setup(thread)
   agents[#agents + 1] = thread
   thread:set("agent", #agents)
end

-- each agent's state (globals of its thread's Lua state: done() reads them)
ok, shed, later_turns_shed, failed, lost, conversations, finished = 0, 0, 0, 0, 0, 0, 0
ok_ms, shed_ms, failed_statuses = {}, {}, {}
pending = false

local turns, think_ms, prefix, bodies, headers
local conversation, turn, wait_ms, sent_at = 0, 0, 0, 0

local function think()
   return think_ms * (0.5 + math.random())
end

function init(args)
   turns, think_ms, prefix = tonumber(args[1]), tonumber(args[2]), args[3]
   bodies = {}
   for line in io.lines(args[4]) do
      bodies[#bodies + 1] = line
   end
   headers = { ["Content-Type"] = "application/json" }
   local token = os.getenv("AGL_BENCH_TOKEN")
   if token and token ~= "" then
      headers["Authorization"] = "Bearer " .. token
   end
   math.randomseed(agent * 7919 + os.time())
   turn = turns -- the first call starts a conversation
   wait_ms = math.random() * think_ms -- the agents do not all start at once
end

function delay()
   return wait_ms
end

local verified = false

function request()
   if agent == 1 and not verified then -- wrk asks thread 1 for a request once before the run, to check it
      verified = true
      return wrk.format("POST", "/", headers, bodies[1])
   end
   if pending then -- the connection broke under the last call: its conversation is lost
      lost = lost + 1
      turn = turns
   end
   if turn >= turns then
      conversation, turn = conversation + 1, 0
      conversations = conversations + 1
   end
   pending, sent_at = true, now_ms()
   local path = string.format("/rollout/%s-%d-%d/attempt/a/v1/chat/completions", prefix, agent, conversation)
   return wrk.format("POST", path, headers, bodies[turn + 1])
end

local function header(all, name)
   for key, value in pairs(all) do
      if string.lower(key) == name then
         return value
      end
   end
   return nil
end

function response(status, got, body)
   pending = false
   local ms = now_ms() - sent_at
   if status == 200 then
      ok, ok_ms[#ok_ms + 1] = ok + 1, ms
      turn = turn + 1
      if turn >= turns then
         finished = finished + 1
      end
      wait_ms = think()
   elseif status == 429 then -- waited out, the same call sent again
      shed, shed_ms[#shed_ms + 1] = shed + 1, ms
      if turn > 0 then
         later_turns_shed = later_turns_shed + 1
      end
      wait_ms = tonumber(header(got, "retry-after-ms") or "1000") or 1000
   else
      failed = failed + 1
      local key = tostring(status)
      failed_statuses[key] = (failed_statuses[key] or 0) + 1
      turn, wait_ms = turns, think()
   end
end

local function json_numbers(values)
   local parts = {}
   for i, v in ipairs(values) do
      parts[i] = string.format("%.3f", v)
   end
   return "[" .. table.concat(parts, ",") .. "]"
end

local function json_counts(counts)
   local parts = {}
   for key, value in pairs(counts) do
      parts[#parts + 1] = string.format("%q:%d", key, value)
   end
   return "{" .. table.concat(parts, ",") .. "}"
end

function done(summary, latency, requests)
   local names = { "ok", "shed", "later_turns_shed", "failed", "lost", "conversations", "finished" }
   local rows = {}
   for _, thread in ipairs(agents) do
      local fields = {}
      for _, name in ipairs(names) do
         fields[#fields + 1] = string.format("%q:%d", name, thread:get(name))
      end
      fields[#fields + 1] = string.format('"unfinished":%s', tostring(thread:get("pending")))
      fields[#fields + 1] = '"ok_ms":' .. json_numbers(thread:get("ok_ms"))
      fields[#fields + 1] = '"shed_ms":' .. json_numbers(thread:get("shed_ms"))
      fields[#fields + 1] = '"failed_statuses":' .. json_counts(thread:get("failed_statuses"))
      rows[#rows + 1] = "{" .. table.concat(fields, ",") .. "}"
   end
   local e = summary.errors
   local file = assert(io.open(os.getenv("AGL_BENCH_OUT"), "w"))
   file:write(string.format(
      '{"duration_us":%d,"requests":%d,"socket_errors":{"connect":%d,"read":%d,"write":%d,"timeout":%d},"agents":[%s]}\n',
      summary.duration, summary.requests, e.connect, e.read, e.write, e.timeout, table.concat(rows, ",")
   ))
   file:close()
end
