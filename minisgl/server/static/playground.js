// minisgl playground: a chat (and raw completion) page over the server's own OpenAI API.
// Plain browser JavaScript, no build step, no external resources. Every URL is relative to
// the page, so the page works behind an Ingress that serves the API under a path prefix.
"use strict";

const API = new URL(".", location.href); // ".../" whether opened as ".../" or ".../playground"
const KEY_STORAGE = "minisgl.apiKey"; // sessionStorage only: gone when the tab closes

const $ = (id) => document.getElementById(id);
const state = {
  mode: "chat",
  messages: [], // {role, content} of the conversation so far
  controller: null, // AbortController of the running request
};

// ---- settings -----------------------------------------------------------------------------
function numberField(id, parse) {
  const raw = $(id).value.trim();
  if (raw === "") return undefined;
  const value = parse(raw);
  return Number.isFinite(value) ? value : undefined;
}

// Stop strings: one per line, exactly as typed (a comma or a space is a stop string too);
// \n, \t, \r and \\ stand for a newline, a tab, a carriage return and a backslash.
const STOP_ESCAPES = { n: "\n", t: "\t", r: "\r", "\\": "\\" };

function stopStrings(text) {
  return text
    .split("\n")
    .map((line) => line.replace(/\\([ntr\\])/g, (_, c) => STOP_ESCAPES[c]))
    .filter((s) => s.length > 0);
}

function samplingFields() {
  const body = {
    temperature: numberField("temperature", parseFloat),
    top_p: numberField("top_p", parseFloat),
    top_k: numberField("top_k", (s) => parseInt(s, 10)),
    min_p: numberField("min_p", parseFloat),
    max_tokens: numberField("max_tokens", (s) => parseInt(s, 10)),
    seed: numberField("seed", (s) => parseInt(s, 10)),
  };
  const stop = stopStrings($("stop").value);
  if (stop.length > 0) body.stop = stop;
  for (const k of Object.keys(body)) if (body[k] === undefined) delete body[k];
  return body;
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem(KEY_STORAGE);
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = !message;
}

async function errorMessage(resp) {
  try {
    const body = await resp.json();
    if (body && body.error && body.error.message) return `${resp.status}: ${body.error.message}`;
  } catch (_) {
    // not JSON: fall through to the status line
  }
  return `${resp.status} ${resp.statusText}`;
}

async function loadModels() {
  const select = $("model");
  try {
    const resp = await fetch(new URL("v1/models", API), { headers: headers() });
    if (!resp.ok) {
      showError(`listing models failed: ${await errorMessage(resp)}`);
      return;
    }
    const { data } = await resp.json();
    select.replaceChildren(
      ...data.map((m) => {
        const option = document.createElement("option");
        option.value = option.textContent = m.id;
        return option;
      }),
    );
    showError("");
  } catch (err) {
    showError(`listing models failed: ${err}`);
  }
}

// ---- server-sent events -------------------------------------------------------------------
// Yields each `data:` payload of an OpenAI stream, parsed, until [DONE].
async function* events(resp) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

// ---- answers ------------------------------------------------------------------------------
// Splits raw model text into reasoning and answer: Qwen3 writes <think>...</think> first
// when no reasoning parser runs on the server.
function splitThinking(text) {
  const open = text.indexOf("<think>");
  if (open < 0) {
    const close = text.indexOf("</think>"); // the template may have opened it in the prompt
    if (close < 0) return { reasoning: "", answer: text };
    return { reasoning: text.slice(0, close), answer: text.slice(close + 8) };
  }
  const close = text.indexOf("</think>", open);
  if (close < 0) return { reasoning: text.slice(open + 7), answer: text.slice(0, open) };
  return {
    reasoning: text.slice(open + 7, close),
    answer: text.slice(0, open) + text.slice(close + 8),
  };
}

// One answer on the page: its reasoning (folded), its text and its numbers.
class Answer {
  constructor(container, foldThinking) {
    this.foldThinking = foldThinking; // chat: yes; a raw completion shows its text as it is
    this.el = document.createElement("div");
    this.el.className = "message assistant streaming";
    this.details = document.createElement("details");
    this.details.className = "reasoning";
    this.details.hidden = true;
    const summary = document.createElement("summary");
    summary.textContent = "Reasoning";
    this.reasoningEl = document.createElement("div");
    this.details.append(summary, this.reasoningEl);
    this.textEl = document.createElement("div");
    this.textEl.className = "text";
    this.statsEl = document.createElement("div");
    this.statsEl.className = "stats";
    this.el.append(this.details, this.textEl, this.statsEl);
    container.append(this.el);
    this.reasoning = ""; // from delta.reasoning_content (a reasoning parser on the server)
    this.raw = ""; // delta.content / text, possibly with <think> tags
    this.start = performance.now();
    this.first = null;
    this.last = null;
    this.chunks = 0;
    this.usage = null;
  }

  add(reasoning, content) {
    if (!reasoning && !content) return;
    const now = performance.now();
    if (this.first === null) this.first = now;
    this.last = now;
    this.chunks += 1;
    this.reasoning += reasoning || "";
    this.raw += content || "";
    this.render();
  }

  parts() {
    const split = this.foldThinking ? splitThinking(this.raw) : { reasoning: "", answer: this.raw };
    return { reasoning: this.reasoning + split.reasoning, answer: split.answer };
  }

  render() {
    const { reasoning, answer } = this.parts();
    this.details.hidden = reasoning.length === 0;
    this.reasoningEl.textContent = reasoning;
    this.textEl.textContent = answer;
    this.el.scrollIntoView({ block: "end" });
  }

  finish(outcome) {
    this.el.classList.remove("streaming");
    this.el.dataset.outcome = outcome;
    const tokens = this.usage ? this.usage.completion_tokens : this.chunks;
    const approx = this.usage ? "" : "~";
    const parts = [];
    if (this.first !== null) parts.push(`TTFT ${Math.round(this.first - this.start)} ms`);
    if (this.first !== null && this.last > this.first && tokens > 1) {
      const rate = (tokens - 1) / ((this.last - this.first) / 1000);
      parts.push(`${rate.toFixed(1)} tokens/s`);
    }
    if (this.usage) parts.push(`prompt ${this.usage.prompt_tokens} tokens`);
    parts.push(`${approx}${tokens} completion tokens`);
    parts.push(outcome);
    this.statsEl.textContent = parts.join(" · ");
    return this.statsEl.textContent;
  }
}

function addMessage(role, text) {
  const el = document.createElement("div");
  el.className = `message ${role}`;
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  el.append(body);
  $("messages").append(el);
  el.scrollIntoView({ block: "end" });
  return el;
}

function setRunning(running) {
  $("send").disabled = running;
  $("stop-button").disabled = !running;
  document.body.classList.toggle("running", running);
}

// Streams one request into `answer`; returns "finished: <reason>", "stopped" or "error".
async function stream(path, body, answer) {
  const controller = new AbortController();
  state.controller = controller;
  setRunning(true);
  showError("");
  let outcome = "error";
  try {
    const resp = await fetch(new URL(path, API), {
      method: "POST",
      headers: headers(),
      body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
      signal: controller.signal,
    });
    if (!resp.ok) {
      showError(await errorMessage(resp));
      return outcome;
    }
    for await (const chunk of events(resp)) {
      if (chunk.error) {
        showError(chunk.error.message);
        return outcome;
      }
      if (chunk.usage) answer.usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      if (choice.delta) answer.add(choice.delta.reasoning_content, choice.delta.content);
      else answer.add(null, choice.text);
      if (choice.finish_reason) outcome = `finished: ${choice.finish_reason}`;
    }
    if (outcome === "error") showError("the stream ended before the answer was finished");
  } catch (err) {
    if (controller.signal.aborted) outcome = "stopped";
    else showError(String(err));
  } finally {
    state.controller = null;
    setRunning(false);
  }
  return outcome;
}

async function sendChat() {
  const input = $("input");
  const text = input.value.trim();
  if (!text || state.controller) return;
  input.value = "";
  // The conversation this turn belongs to: Clear starts a new one while the answer may still
  // be streaming, and the old answer must not land in the new conversation.
  const conversation = state.messages;
  const question = { role: "user", content: text };
  conversation.push(question);
  const questionEl = addMessage("user", text);
  const system = $("system").value.trim();
  const messages = system ? [{ role: "system", content: system }, ...conversation] : [...conversation];
  const body = {
    model: $("model").value || undefined,
    messages,
    chat_template_kwargs: { enable_thinking: $("thinking").checked },
    ...samplingFields(),
  };
  const answer = new Answer($("messages"), true);
  const outcome = await stream("v1/chat/completions", body, answer);
  answer.finish(outcome);
  // Only the answer goes back into the conversation, as Qwen3's template expects.
  const reply = answer.parts().answer;
  if (outcome.startsWith("finished") || (outcome === "stopped" && reply)) {
    conversation.push({ role: "assistant", content: reply });
    return;
  }
  // No answer (the request failed, or was stopped before any text): the question leaves the
  // conversation, so the next request does not carry a question with an empty answer. It
  // stays on the page, marked, and goes back into the input to be sent again.
  conversation.splice(conversation.indexOf(question), 1);
  for (const el of [questionEl, answer.el]) {
    el.classList.add("unsent");
    el.title = "Not part of the conversation: no answer came back";
  }
  if (conversation === state.messages && !input.value) input.value = text;
}

async function sendCompletion() {
  const prompt = $("raw-prompt").value;
  if (!prompt || state.controller) return;
  const output = $("raw-output");
  output.replaceChildren();
  output.hidden = false;
  const answer = new Answer(output, false);
  const body = { model: $("model").value || undefined, prompt, ...samplingFields() };
  const outcome = await stream("v1/completions", body, answer);
  const stats = answer.finish(outcome);
  $("raw-stats").textContent = stats;
  $("raw-stats").hidden = false;
}

function setMode(mode) {
  state.mode = mode;
  const chat = mode === "chat";
  $("mode-chat").classList.toggle("active", chat);
  $("mode-completion").classList.toggle("active", !chat);
  for (const id of ["messages", "input", "system-row", "thinking-row"]) $(id).hidden = !chat;
  for (const id of ["raw-prompt", "raw-output"]) $(id).hidden = chat || (id === "raw-output" && !$(id).hasChildNodes());
  $("raw-stats").hidden = chat || !$("raw-stats").textContent;
}

function init() {
  const key = $("api-key");
  key.value = sessionStorage.getItem(KEY_STORAGE) || "";
  key.addEventListener("change", () => {
    if (key.value) sessionStorage.setItem(KEY_STORAGE, key.value);
    else sessionStorage.removeItem(KEY_STORAGE);
    loadModels();
  });
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    if (state.mode === "chat") sendChat();
    else sendCompletion();
  });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("raw-prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  // Aborting the fetch closes the connection; the server then aborts the request.
  $("stop-button").addEventListener("click", () => state.controller && state.controller.abort());
  $("clear").addEventListener("click", () => {
    if (state.controller) state.controller.abort();
    state.messages = [];
    $("messages").replaceChildren();
    $("raw-output").replaceChildren();
    $("raw-stats").textContent = "";
    setMode(state.mode);
    showError("");
  });
  $("mode-chat").addEventListener("click", () => setMode("chat"));
  $("mode-completion").addEventListener("click", () => setMode("completion"));
  setMode("chat");
  loadModels();
}

// Inserted from the page's head, this may run before the body is parsed.
if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
else init();
