// The chat page: streams /v1/chat/completions (server-sent events) and shows live tokens/s and τ.
// Plain JS, no build step. τ comes from the server's `mtp` extension: every content chunk carries
// {tokens, steps} so far (τ = tokens after the first / verify steps), the final chunk the request's τ.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { model: null, history: [], controller: null, runs: 0 };

function authHeaders() {
  const key = $("api-key").value || localStorage.getItem("mtp-api-key") || "";
  if (key) localStorage.setItem("mtp-api-key", key);
  return key ? { Authorization: "Bearer " + key } : {};
}

async function init() {
  const health = await (await fetch("/health")).json();
  state.model = health.model;
  $("model-name").textContent = health.model;
  if (health.note) { $("note").textContent = health.note; $("note").hidden = false; }
  $("speculative").checked = health.speculative_default !== false;
  if (health.auth_required) {
    $("key-label").hidden = false;
    $("api-key").value = localStorage.getItem("mtp-api-key") || "";
  }
  document.body.dataset.ready = "true";
}

function addMessage(role, text) {
  const el = document.createElement("div");
  el.className = "msg " + role;
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  el.appendChild(body);
  $("chat").appendChild(el);
  el.scrollIntoView({ block: "end" });
  return el;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("again").disabled = busy;
  $("stop").disabled = !busy;
}

function fmt(x, digits) { return Number.isFinite(x) ? x.toFixed(digits) : "–"; }

function showLive(s) {
  $("live-tokens").textContent = s.tokens;
  $("live-tps").textContent = fmt(s.tps, 1);
  $("live-tau").textContent = fmt(s.tau, 2);
  $("live-ttft").textContent = s.ttft == null ? "–" : fmt(s.ttft, 2) + " s";
}

function addRun(s) {
  const row = document.createElement("tr");
  const cells = [++state.runs, s.speculative ? "on" : "off", s.tokens,
                 s.ttft == null ? "–" : fmt(s.ttft, 2) + " s", fmt(s.tps, 1), fmt(s.tau, 2)];
  for (const c of cells) { const td = document.createElement("td"); td.textContent = c; row.appendChild(td); }
  $("runs").querySelector("tbody").appendChild(row);
}

async function ask() {
  const speculative = $("speculative").checked;
  const el = addMessage("assistant", "");
  el.dataset.state = "streaming";
  const textEl = el.querySelector(".text");
  const meta = document.createElement("span");
  meta.className = "meta";
  el.appendChild(meta);
  const s = { tokens: 0, steps: 0, tps: NaN, tau: NaN, ttft: null, speculative };
  const t0 = performance.now();
  let tFirst = null, answer = "", finish = null, chunks = 0;
  state.controller = new AbortController();
  setBusy(true);
  const update = () => {
    const now = performance.now();
    if (tFirst != null && s.tokens > 1) s.tps = (s.tokens - 1) / ((now - tFirst) / 1000);
    showLive(s);
    meta.textContent = `${s.tokens} tokens · ${fmt(s.tps, 1)} tok/s · τ ${fmt(s.tau, 2)} · ` +
      `speculation ${speculative ? "on" : "off"}` + (finish ? ` · ${finish}` : "");
  };
  const onEvent = (data) => {
    if (data === "[DONE]") return;
    const obj = JSON.parse(data);
    if (obj.error) throw new Error(obj.error.message);
    const choice = obj.choices && obj.choices[0];
    if (choice && choice.delta && choice.delta.content) {
      if (tFirst == null) { tFirst = performance.now(); s.ttft = (tFirst - t0) / 1000; }
      answer += choice.delta.content;
      textEl.textContent = answer;
      el.dataset.chunks = ++chunks;  // how many pieces streamed in (the browser test reads it)
    }
    if (obj.mtp && obj.mtp.tokens != null) {
      s.tokens = obj.mtp.tokens; s.steps = obj.mtp.steps;
      if (s.steps > 0) s.tau = (s.tokens - 1) / s.steps;
    }
    if (obj.mtp && obj.mtp.tau != null && obj.mtp.verify_steps > 0) s.tau = obj.mtp.tau;
    if (choice && choice.finish_reason) finish = choice.finish_reason;
    if (obj.usage) s.tokens = obj.usage.completion_tokens;
    update();
  };
  try {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json", ...authHeaders() },
      signal: state.controller.signal,
      body: JSON.stringify({
        model: state.model, messages: state.history, stream: true, stream_options: { include_usage: true },
        max_tokens: Number($("max-tokens").value) || 256, temperature: Number($("temperature").value) || 0,
        speculative,
      }),
    });
    if (!resp.ok) {
      let message = resp.status + " " + resp.statusText;
      try { message = (await resp.json()).error.message; } catch (_) { /* not JSON */ }
      throw new Error(message);
    }
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) if (line.startsWith("data: ")) onEvent(line.slice(6));
      }
    }
    state.history.push({ role: "assistant", content: answer });
    el.dataset.state = "done";
    addRun(s);
  } catch (err) {
    const stopped = err.name === "AbortError";
    el.dataset.state = stopped ? "done" : "error";
    finish = stopped ? "stopped" : finish;
    if (!stopped) {
      const e = document.createElement("div");
      e.className = "error";
      e.textContent = "Error: " + err.message;
      el.appendChild(e);
    }
    state.history.push({ role: "assistant", content: answer });
  } finally {
    update();
    state.controller = null;
    setBusy(false);
  }
}

function send(ev) {
  ev.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.controller) return;
  $("prompt").value = "";
  addMessage("user", text);
  state.history.push({ role: "user", content: text });
  ask();
}

function again() {
  if (state.controller) return;
  while (state.history.length && state.history[state.history.length - 1].role === "assistant") state.history.pop();
  if (!state.history.length) return;
  ask();
}

$("composer").addEventListener("submit", send);
$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) send(ev);
});
$("again").addEventListener("click", again);
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
$("clear").addEventListener("click", () => { state.history = []; $("chat").textContent = ""; });
init().catch((err) => { $("note").textContent = "Cannot reach the server: " + err.message; $("note").hidden = false; });
