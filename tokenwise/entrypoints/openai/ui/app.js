// tokenwise's page: the API key, the tabs, the chat playground and the completions tab.
// Plain JavaScript, no build step and nothing from the network but this server. Model output
// is only ever written with textContent (never as HTML). engine.js draws the engine tab.
"use strict";

const $ = (selector) => document.querySelector(selector);
const KEY_STORAGE = "tokenwise-api-key";
const page = {
  key: sessionStorage.getItem(KEY_STORAGE) || "",
  history: [], // chat messages so far (without the system prompt, added at send time)
  running: null, // the AbortController of the request in flight
  onTab: {}, // tab name -> function(active) that engine.js registers
};

class AuthError extends Error {}

function authHeaders(extra) {
  const headers = Object.assign({}, extra || {});
  if (page.key) headers.Authorization = "Bearer " + page.key;
  return headers;
}

// fetch with the key; a 401 opens the key dialog and throws AuthError.
async function api(path, options) {
  options = options || {};
  const response = await fetch(path, Object.assign({}, options, { headers: authHeaders(options.headers) }));
  if (response.status === 401) {
    askForKey(page.key ? "The server refused this API key (401). Enter the right one." : "This server needs an API key.");
    throw new AuthError("the server needs a valid API key");
  }
  return response;
}

async function errorText(response) {
  const text = await response.text();
  try {
    return JSON.parse(text).error.message;
  } catch (_) {
    return `HTTP ${response.status}: ${text.slice(0, 300)}`;
  }
}

function askForKey(message) {
  $("#key-message").textContent = message;
  $("#key-dialog").hidden = false;
  $("#key-input").value = "";
  $("#key-input").focus();
}

$("#key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  page.key = $("#key-input").value.trim();
  sessionStorage.setItem(KEY_STORAGE, page.key);
  $("#key-dialog").hidden = true;
  loadModels();
});
$("#key-button").addEventListener("click", () => askForKey("API key for this server (kept for this tab only)."));

async function loadModels() {
  try {
    const response = await api("/v1/models");
    if (!response.ok) throw new Error(await errorText(response));
    const models = (await response.json()).data;
    const select = $("#model");
    const previous = select.value;
    select.textContent = "";
    for (const card of models) {
      const option = document.createElement("option");
      option.value = card.id;
      option.textContent = card.parent ? `${card.id} (LoRA on ${card.parent})` : card.id;
      select.appendChild(option);
    }
    if (previous) select.value = previous;
    if (!select.value && models.length) select.value = models[0].id;
    $("#server-status").textContent = `model ${models[0].id}, context ${models[0].max_model_len} tokens`;
    for (const name in page.onTab) page.onTab[name](!$("#tab-" + name).hidden);
  } catch (err) {
    if (!(err instanceof AuthError)) $("#server-status").textContent = "cannot list models: " + err.message;
  }
}

// ---- tabs ---------------------------------------------------------------------------------------

for (const button of document.querySelectorAll(".tab")) {
  button.addEventListener("click", () => {
    for (const other of document.querySelectorAll(".tab")) {
      const active = other === button;
      other.classList.toggle("active", active);
      $("#tab-" + other.dataset.tab).hidden = !active;
      if (page.onTab[other.dataset.tab]) page.onTab[other.dataset.tab](active);
    }
  });
}

// ---- streaming ----------------------------------------------------------------------------------

// The `data:` payloads of a server-sent-events body, read with fetch (EventSource sends no key).
async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart());
      if (data.length) yield data.join("\n");
    }
  }
}

function samplingFields() {
  const body = {
    model: $("#model").value || undefined,
    temperature: Number($("#temperature").value),
    top_p: Number($("#top-p").value),
    max_tokens: Number($("#max-tokens").value),
    stream: true,
    stream_options: { include_usage: true },
  };
  if ($("#ignore-eos").checked) body.ignore_eos = true; // the vLLM extension tokenwise accepts
  return body;
}

// Stream one request; `on.text(piece)` and `on.toolCalls(deltas)` as they come. Resolves to a
// summary: usage, time to first token, tokens per second, finish reason, or how it ended early.
async function streamGeneration(path, body, on) {
  const controller = new AbortController();
  page.running = controller;
  const started = performance.now();
  let first = null;
  let usage = null;
  let finish = null;
  let pieces = 0;
  let outcome = "done";
  try {
    const response = await api(path, {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    for await (const data of sseData(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const text = choice.delta ? choice.delta.content : choice.text;
        const calls = choice.delta && choice.delta.tool_calls;
        if ((text || calls) && first === null) first = performance.now();
        if (text) {
          pieces += 1;
          on.text(text);
        }
        if (calls) on.toolCalls(calls);
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    }
  } catch (err) {
    if (err.name === "AbortError") outcome = "stopped";
    else outcome = err;
  } finally {
    page.running = null;
  }
  return { usage, finish, pieces, outcome, started, first, ended: performance.now() };
}

function describe(result) {
  if (result.outcome instanceof Error) return result.outcome.message;
  const parts = [];
  const ttft = result.first === null ? null : (result.first - result.started) / 1000;
  if (result.usage) {
    const out = result.usage.completion_tokens;
    parts.push(`${result.usage.prompt_tokens} prompt + ${out} output tokens`);
    if (ttft !== null) parts.push(`time to first token ${ttft.toFixed(3)} s`);
    const decode = (result.ended - result.first) / 1000;
    if (out > 1 && decode > 0) parts.push(`${((out - 1) / decode).toFixed(1)} tok/s`);
  } else {
    parts.push(`${result.pieces} pieces received`);
    if (ttft !== null) parts.push(`time to first token ${ttft.toFixed(3)} s`);
  }
  if (result.outcome === "stopped") parts.push("stopped");
  else if (result.finish) parts.push(`finish: ${result.finish}`);
  return parts.join(" · ");
}

function setBusy(send, stop, busy) {
  $(send).disabled = busy;
  $(stop).disabled = !busy;
}

// ---- chat ---------------------------------------------------------------------------------------

function addMessage(role, text) {
  const box = document.createElement("div");
  box.className = "msg " + role;
  const label = document.createElement("div");
  label.className = "role";
  label.textContent = role;
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  box.append(label, content);
  $("#chat-log").appendChild(box);
  box.scrollIntoView({ block: "end" });
  return box;
}

function chatTools(body) {
  const raw = $("#tools").value.trim();
  if (!raw) return;
  let tools;
  try {
    tools = JSON.parse(raw);
  } catch (err) {
    throw new Error("the tools are not valid JSON: " + err.message);
  }
  body.tools = tools;
  body.tool_choice = $("#tool-choice").value;
}

async function sendChat() {
  const text = $("#chat-input").value;
  if (!text.trim() || page.running) return;
  const body = samplingFields();
  try {
    chatTools(body);
  } catch (err) {
    addMessage("error", err.message);
    return;
  }
  $("#chat-input").value = "";
  addMessage("user", text);
  page.history.push({ role: "user", content: text });
  const system = $("#system-prompt").value.trim();
  body.messages = (system ? [{ role: "system", content: system }] : []).concat(page.history);
  const box = addMessage("assistant", "");
  const content = box.querySelector(".content");
  const calls = {};
  const callBox = document.createElement("div");
  box.appendChild(callBox);
  setBusy("#chat-send", "#chat-stop", true);
  const result = await streamGeneration("/v1/chat/completions", body, {
    text: (piece) => {
      content.textContent += piece;
      box.scrollIntoView({ block: "end" });
    },
    toolCalls: (deltas) => {
      for (const delta of deltas) {
        const call = (calls[delta.index] = calls[delta.index] || { name: "", arguments: "" });
        if (delta.function && delta.function.name) call.name += delta.function.name;
        if (delta.function && delta.function.arguments) call.arguments += delta.function.arguments;
      }
      callBox.textContent = "";
      for (const index of Object.keys(calls)) {
        const line = document.createElement("div");
        line.className = "tool-call";
        line.textContent = `tool call: ${calls[index].name}(${calls[index].arguments})`;
        callBox.appendChild(line);
      }
    },
  });
  setBusy("#chat-send", "#chat-stop", false);
  const stats = document.createElement("div");
  stats.className = "stats" + (result.outcome instanceof Error ? " error" : "");
  stats.textContent = describe(result);
  box.appendChild(stats);
  if (result.outcome instanceof Error) page.history.pop();
  else page.history.push({ role: "assistant", content: content.textContent });
}

$("#chat-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sendChat();
});
$("#chat-input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    sendChat();
  }
});
$("#chat-stop").addEventListener("click", () => page.running && page.running.abort());
$("#chat-clear").addEventListener("click", () => {
  page.history = [];
  $("#chat-log").textContent = "";
});

// ---- completions --------------------------------------------------------------------------------

$("#completion-send").addEventListener("click", async () => {
  if (page.running) return;
  const prompt = $("#completion-prompt").value;
  const body = Object.assign(samplingFields(), { prompt });
  $("#completion-output .prompt-echo").textContent = prompt;
  const generated = $("#completion-output .generated");
  generated.textContent = "";
  $("#completion-stats").textContent = "";
  setBusy("#completion-send", "#completion-stop", true);
  const result = await streamGeneration("/v1/completions", body, {
    text: (piece) => (generated.textContent += piece),
    toolCalls: () => {},
  });
  setBusy("#completion-send", "#completion-stop", false);
  $("#completion-stats").textContent = describe(result);
  $("#completion-stats").classList.toggle("error", result.outcome instanceof Error);
});
$("#completion-stop").addEventListener("click", () => page.running && page.running.abort());

window.addEventListener("load", loadModels);
