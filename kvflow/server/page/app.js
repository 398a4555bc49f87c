// kvflow's page: a chat with the served model over the server's own OpenAI-compatible streaming API, with
// where each answer's time went (usage.kvflow_timings), and a live view of the engine (GET kvflow/live).
//
// Everything the model or the user writes is put on the page as text (textContent), never as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORAGE = "kvflow-api-key";
const POLL_MS = 500;
const CHART_STEPS = 240;

const state = {
  model: null,
  history: [],          // {role, content, node} of the conversation so far
  controller: null,     // the answer being streamed (AbortController)
  since: 0,             // the last engine step the live panel has seen
  steps: [],            // the last CHART_STEPS step records
  limits: null,         // what this machine allows the model (null: not measured)
  liveOff: false,
};

// ---- small helpers ---------------------------------------------------------------------------------
function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function fmt(value, digits = 0) {
  return Number(value).toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits });
}

function ms(value) {
  if (value === null || value === undefined) return "-";
  return value >= 1000 ? `${fmt(value / 1000, 2)} s` : `${fmt(value, value < 10 ? 1 : 0)} ms`;
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem(KEY_STORAGE);
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

// Ask for the key once at a time; resolves when the user has given one.
let keyPrompt = null;
function askForKey() {
  if (!keyPrompt) {
    keyPrompt = new Promise((resolve) => {
      const dialog = $("key-dialog");
      dialog.addEventListener("close", () => {
        const key = $("api-key").value.trim();
        if (key) sessionStorage.setItem(KEY_STORAGE, key);
        keyPrompt = null;
        resolve();
      }, { once: true });
      dialog.showModal();
      $("api-key").focus();
    });
  }
  return keyPrompt;
}

// fetch with the key; on 401, ask for it and try once more.
async function api(path, options = {}) {
  let response = await fetch(path, { ...options, headers: headers() });
  if (response.status === 401) {
    await askForKey();
    response = await fetch(path, { ...options, headers: headers() });
  }
  return response;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || body.detail || JSON.stringify(body);
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

// The data: events of a text/event-stream body, parsed as JSON, until [DONE].
async function* serverEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

// ---- the conversation ------------------------------------------------------------------------------
function addMessage(role, content) {
  const node = el("div", `message ${role}`);
  node.append(el("div", "role", role === "user" ? "You" : state.model || "Model"));
  const thinking = el("div", "thinking");
  thinking.hidden = true;
  node.append(thinking, el("div", "text", content));
  $("messages").append(node);
  node.scrollIntoView({ block: "end" });
  const entry = { role, content, node };
  state.history.push(entry);
  return entry;
}

function sampling() {
  const body = {
    temperature: Number($("temperature").value),
    top_p: Number($("top_p").value),
    max_tokens: Math.max(1, Math.floor(Number($("max_tokens").value) || 1)),
  };
  const seed = $("seed").value.trim();
  if (seed !== "") body.seed = Math.floor(Number(seed));
  return body;
}

function requestMessages() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  for (const m of state.history) if (m.content !== "" || m.role === "user") messages.push({ role: m.role, content: m.content });
  return messages;
}

function setStreaming(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
  $("new-chat").disabled = on;
  for (const button of document.querySelectorAll(".regenerate")) button.disabled = on;
}

async function send(text) {
  if (state.controller) return;
  if (text !== null) addMessage("user", text);
  const messages = requestMessages();
  const answer = addMessage("assistant", "");
  answer.node.classList.add("streaming");
  const textNode = answer.node.querySelector(".text");
  const thinkingNode = answer.node.querySelector(".thinking");
  const controller = new AbortController();
  state.controller = controller;
  setStreaming(true);
  const started = performance.now();
  let firstToken = null;
  let chunks = 0;
  let usage = null;
  let finish = null;
  try {
    const response = await api("v1/chat/completions", {
      method: "POST",
      signal: controller.signal,
      body: JSON.stringify({ model: state.model || undefined, messages, stream: true,
                             stream_options: { include_usage: true }, ...sampling() }),
    });
    if (!response.ok) throw new Error(await errorText(response));
    for await (const chunk of serverEvents(response)) {
      if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const delta = choice.delta || {};
        if (delta.reasoning_content) {
          thinkingNode.hidden = false;
          thinkingNode.textContent += delta.reasoning_content;
        }
        if (delta.content) {
          if (firstToken === null) firstToken = performance.now();
          chunks += 1;
          answer.content += delta.content;
          textNode.textContent = answer.content;
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      answer.node.scrollIntoView({ block: "end" });
    }
    showTiming(answer, usage, finish);
  } catch (error) {
    if (controller.signal.aborted) {
      const elapsed = performance.now() - started;
      answer.node.dataset.finish = "stopped";
      const line = el("div", "timing", `stopped after ${ms(elapsed)}` +
        (firstToken === null ? ", before the first token" : ` (first token after ${ms(firstToken - started)}, ${chunks} chunks)`));
      answer.node.append(line);
    } else {
      answer.node.dataset.finish = "error";
      answer.node.append(el("div", "error", `Error: ${error.message}`));
    }
  } finally {
    answer.node.classList.remove("streaming");
    state.controller = null;
    addActions(answer);
    setStreaming(false);
    $("prompt").focus();
  }
}

// Where the answer's time went, from usage.kvflow_timings, beside what the machine allows.
function showTiming(answer, usage, finish) {
  answer.node.dataset.finish = finish || "unknown";
  if (!usage || !usage.kvflow_timings) return;
  const t = usage.kvflow_timings;
  const prompt = usage.prompt_tokens, completion = usage.completion_tokens, cached = t.cached_tokens || 0;
  const computed = prompt - cached;
  const parts = [`queue ${ms(t.queue_ms)}`, `TTFT ${ms(t.ttft_ms)}`];
  let prefillRate = null;
  if (t.prefill_ms > 0) prefillRate = computed / (t.prefill_ms / 1000);
  const fromDisk = t.disk_cached_tokens ? `, ${fmt(t.disk_cached_tokens)} of them from disk` : "";
  parts.push(`prefill ${fmt(prompt)} tokens (${fmt(cached)} from the prefix cache${fromDisk})` +
             (prefillRate ? ` at ${fmt(prefillRate)} tok/s` : ""));
  let decodeRate = null;
  if (completion > 1 && t.decode_ms > 0) {
    const tpot = t.decode_ms / (completion - 1);
    decodeRate = 1000 / tpot;
    parts.push(`decode ${fmt(completion)} tokens, TPOT ${ms(tpot)} = ${fmt(decodeRate, 1)} tok/s`);
  } else {
    parts.push(`${fmt(completion)} token${completion === 1 ? "" : "s"}`);
  }
  if (t.spec_draft_tokens) parts.push(`speculation kept ${fmt(t.spec_accepted_tokens)} of ${fmt(t.spec_draft_tokens)} guesses`);
  const line = el("div", "timing", parts.join(" · "));
  Object.assign(line.dataset, { promptTokens: prompt, cachedTokens: cached, completionTokens: completion });
  const roof = rooflineText(prompt, cached, completion, prefillRate, decodeRate);
  if (roof) line.append(el("div", "roofline", roof));
  answer.node.append(line, timeBar(t));
}

// "decode at 78% of what memory bandwidth allows": the decode ceiling reads the weights and the
// sequence's K/V (at its mean context) once a step; the prefill ceiling is the matmul rate over the
// prompt's FLOPs.
function rooflineText(prompt, cached, completion, prefillRate, decodeRate) {
  const limits = state.limits;
  if (!limits || !limits.machine) return "";
  const m = limits.machine, model = limits.model;
  const parts = [];
  if (decodeRate) {
    const bytes = model.weight_bytes_per_step + model.kv_bytes_per_token * (prompt + completion / 2);
    const ceiling = m.bandwidth_bytes_per_s / bytes;
    parts.push(`decode at ${fmt(100 * decodeRate / ceiling)}% of what memory bandwidth allows (${fmt(ceiling)} tok/s)`);
  }
  const n = prompt - cached;
  if (prefillRate && n > 0 && m.matmul_flop_per_s) {
    const flops = n * model.flops_per_token + model.attention_flops_per_context_token * (n * cached + n * (n + 1) / 2);
    const ceiling = m.matmul_flop_per_s * n / flops;
    parts.push(`prefill at ${fmt(100 * prefillRate / ceiling)}% of what the matmul rate allows (${fmt(ceiling)} tok/s)`);
  }
  return parts.join(" · ");
}

function timeBar(t) {
  const bar = el("div", "timebar");
  const spans = [["queue", t.queue_ms], ["prefill", t.prefill_ms], ["decode", t.decode_ms]];
  const total = spans.reduce((sum, [, v]) => sum + (v || 0), 0);
  if (total <= 0) return bar;
  for (const [name, value] of spans) {
    const span = el("span", name);
    span.style.width = `${(100 * (value || 0)) / total}%`;
    span.title = `${name} ${ms(value)}`;
    bar.append(span);
  }
  return bar;
}

function addActions(answer) {
  const actions = el("div", "actions");
  const copy = el("button", "secondary copy", "Copy");
  copy.type = "button";
  copy.addEventListener("click", () => copyText(answer.content, copy));
  actions.append(copy);
  const last = state.history[state.history.length - 1] === answer;
  if (last) {
    for (const old of document.querySelectorAll(".regenerate")) old.remove();
    const again = el("button", "secondary regenerate", "Regenerate");
    again.type = "button";
    again.addEventListener("click", regenerate);
    actions.append(again);
  }
  answer.node.append(actions);
}

async function copyText(text, button) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    const area = el("textarea");
    area.value = text;
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  button.textContent = "Copied";
  setTimeout(() => { button.textContent = "Copy"; }, 1200);
}

function regenerate() {
  if (state.controller) return;
  const last = state.history[state.history.length - 1];
  if (!last || last.role !== "assistant") return;
  state.history.pop();
  last.node.remove();
  send(null);
}

function newChat() {
  if (state.controller) return;
  state.history = [];
  $("messages").replaceChildren();
}

// ---- the live panel --------------------------------------------------------------------------------
async function poll() {
  if (state.liveOff) return;
  try {
    const response = await api(`kvflow/live?since=${state.since}`);
    if (response.status === 404) {  // metrics are off: the page stays a plain chat
      state.liveOff = true;
      $("live").hidden = true;
      await showModelName();
      return;
    }
    if (!response.ok) throw new Error(await errorText(response));
    const live = await response.json();
    $("connection").textContent = "";
    showLive(live);
  } catch (error) {
    $("connection").textContent = `(server unreachable: ${error.message})`;
  }
  setTimeout(poll, POLL_MS);
}

async function showModelName() {
  try {
    const response = await api("v1/models");
    if (!response.ok) return;
    const models = await response.json();
    if (models.data && models.data.length) {
      state.model = models.data[0].id;
      $("model-name").textContent = state.model;
    }
  } catch {
    // the name is a nicety: the chat works without it
  }
}

function showLive(live) {
  $("live").hidden = false;
  if (!state.model) {
    state.model = live.model;
    $("model-name").textContent = `${live.model} · context ${fmt(live.max_model_len)} tokens · KV cache ${fmt(live.kv_capacity_tokens)} tokens`;
  }
  $("running").textContent = live.running;
  $("waiting").textContent = live.waiting;
  $("kv-usage").textContent = `${fmt(100 * live.kv_cache_usage, 1)}% (${fmt(live.kv_blocks_used)} of ${fmt(live.kv_blocks_total)} blocks)`;
  $("kv-meter").value = live.kv_cache_usage;
  $("prefix-hits").textContent = live.prefix_queried_tokens
    ? `${fmt(100 * live.prefix_cache_hit_rate, 1)}% (${fmt(live.prefix_hit_tokens)} of ${fmt(live.prefix_queried_tokens)} prompt tokens)`
    : "-";
  if (live.steps.length) {
    state.since = live.steps[live.steps.length - 1].step;
    state.steps.push(...live.steps);
    state.steps.splice(0, Math.max(0, state.steps.length - CHART_STEPS));
  }
  const now = Date.now() / 1000;
  const recent = state.steps.filter((s) => now - s.t <= 1);
  const prefill = recent.reduce((sum, s) => sum + s.prefill_tokens, 0);
  const decode = recent.reduce((sum, s) => sum + s.decode_tokens, 0);
  $("rate").textContent = `${recent.length} steps, ${fmt(prefill)} prompt and ${fmt(decode)} decode tokens`;
  drawSteps();
  state.limits = live.limits;
  showMachine(live.limits);
}

// Prompt tokens per step above the axis, decode tokens below, each on its own scale: a long prompt's
// chunks show up between other requests' decode steps.
function drawSteps() {
  const canvas = $("steps-chart");
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height, mid = Math.round(h * 0.62);
  ctx.clearRect(0, 0, w, h);
  const steps = state.steps;
  const maxPrefill = Math.max(1, ...steps.map((s) => s.prefill_tokens));
  const maxDecode = Math.max(1, ...steps.map((s) => s.decode_tokens));
  const bar = w / CHART_STEPS;
  const styles = getComputedStyle(document.documentElement);
  steps.forEach((s, i) => {
    const x = w - (steps.length - i) * bar;
    ctx.fillStyle = styles.getPropertyValue("--prefill");
    const up = ((mid - 12) * s.prefill_tokens) / maxPrefill;
    ctx.fillRect(x, mid - up, Math.max(1, bar - 0.5), up);
    ctx.fillStyle = styles.getPropertyValue("--decode");
    const down = ((h - mid - 12) * s.decode_tokens) / maxDecode;
    ctx.fillRect(x, mid, Math.max(1, bar - 0.5), down);
  });
  ctx.fillStyle = styles.getPropertyValue("--muted");
  ctx.fillRect(0, mid, w, 1);
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillText(`${fmt(maxPrefill)} prompt tokens`, 4, 11);
  ctx.fillText(`${fmt(maxDecode)} decode tokens`, 4, h - 3);
}

function showMachine(limits) {
  const box = $("machine");
  const lines = [];
  const m = limits.machine;
  if (m) {
    const bw = m.bandwidth_bytes_per_s, model = limits.model;
    lines.push(`${m.cpu || "this device"}${m.tier ? ` (kernel tier ${m.tier})` : ""}, ${m.threads} thread${m.threads === 1 ? "" : "s"}`);
    lines.push(`Memory bandwidth ${fmt(bw / 1e9, 1)} GB/s: decode can reach at most ${fmt(bw / model.weight_bytes_per_step)} tok/s ` +
               `at batch 1 on a short context (${fmt(model.weight_bytes_per_step / 2 ** 20)} MiB of weights a step, ` +
               `plus ${fmt(model.kv_bytes_per_token / 1024, 1)} KiB of K/V per token of context)`);
    if (m.matmul_flop_per_s) {
      lines.push(`Matmul rate ${fmt(m.matmul_flop_per_s / 1e12, 2)} TFLOP/s (${m.matmul_kind}): prefill can reach at most ` +
                 `${fmt(m.matmul_flop_per_s / model.flops_per_token)} tok/s`);
    }
    if (m.date) lines.push(`Measured ${m.date}`);
  } else if (limits.probing) {
    lines.push("Measuring this machine...");
  } else {
    lines.push("Not measured yet: measure it (or run `kvflow bench probe`) to see each answer against what the machine allows.");
  }
  if (limits.probe_error) lines.push(`The last measurement failed: ${limits.probe_error}`);
  box.replaceChildren(...lines.map((text) => el("p", "", text)));
  $("probe").hidden = Boolean(m) || limits.probing;
}

async function probe() {
  $("probe").disabled = true;
  try {
    const response = await api("kvflow/probe", { method: "POST", body: "{}" });
    if (!response.ok) throw new Error(await errorText(response));
  } catch (error) {
    $("machine").append(el("p", "error", `Could not start: ${error.message}`));
  } finally {
    $("probe").disabled = false;
  }
}

// ---- wiring ----------------------------------------------------------------------------------------
function init() {
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || state.controller) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("new-chat").addEventListener("click", newChat);
  $("probe").addEventListener("click", probe);
  poll();
  $("prompt").focus();
}

document.addEventListener("DOMContentLoaded", init);
