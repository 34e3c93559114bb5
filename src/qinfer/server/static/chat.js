// The chat page: a conversation with the served model over /v1/chat/completions (SSE).
//
// The conversation lives in `chat.messages` ({role, content, reasoning?, stats?, error?})
// and in localStorage, so a reload keeps it. Each answer streams in; its reasoning (Qwen3's
// <think> block, split by the server into reasoning_content) shows in a collapsible block;
// Stop aborts the fetch, which closes the connection, and the server aborts the request.

import { APIError, events, request, setUpPage } from "./api.js";
import { renderMarkdown } from "./markdown.js";
import { element } from "./dom.js";

const CHAT_STORAGE = "qinfer.chat";
const SETTINGS_STORAGE = "qinfer.chatSettings";
const SETTINGS = ["system", "temperature", "top-p", "max-tokens", "thinking"];

const $ = (id) => document.getElementById(id);
const chat = { messages: loadMessages(), running: null };

function loadMessages() {
  try {
    return JSON.parse(localStorage.getItem(CHAT_STORAGE)) || [];
  } catch {
    return [];
  }
}

function saveMessages() {
  localStorage.setItem(CHAT_STORAGE, JSON.stringify(chat.messages));
}

// --- settings -------------------------------------------------------------------------

function loadSettings() {
  const saved = JSON.parse(localStorage.getItem(SETTINGS_STORAGE) || "{}");
  for (const id of SETTINGS) {
    if (saved[id] !== undefined) $(id).value = saved[id];
    $(id).addEventListener("change", saveSettings);
  }
}

function saveSettings() {
  const values = Object.fromEntries(SETTINGS.map((id) => [id, $(id).value]));
  localStorage.setItem(SETTINGS_STORAGE, JSON.stringify(values));
}

// The request body for the conversation so far (errors and the answer being made left out).
function requestBody(messages) {
  const body = { messages: [], stream: true, stream_options: { include_usage: true } };
  const system = $("system").value.trim();
  if (system) body.messages.push({ role: "system", content: system });
  for (const message of messages) {
    if (!message.error) body.messages.push({ role: message.role, content: message.content });
  }
  const number = (id) => ($(id).value === "" ? undefined : Number($(id).value));
  if (number("temperature") !== undefined) body.temperature = number("temperature");
  if (number("top-p") !== undefined) body.top_p = number("top-p");
  if (number("max-tokens") !== undefined) body.max_tokens = number("max-tokens");
  if ($("thinking").value) body.chat_template_kwargs = { enable_thinking: $("thinking").value === "on" };
  return body;
}

// --- drawing the conversation ---------------------------------------------------------

function statsLine(stats) {
  if (!stats) return "";
  const parts = [];
  if (stats.ttft !== undefined) parts.push(`TTFT ${stats.ttft.toFixed(2)} s`);
  if (stats.tokensPerSecond !== undefined) parts.push(`${stats.tokensPerSecond.toFixed(1)} tok/s`);
  if (stats.tokens !== undefined) parts.push(`${stats.tokens} tokens`);
  if (stats.stopped) parts.push("stopped");
  else if (stats.finish === "length") parts.push("cut at max tokens");
  return parts.join(" · ");
}

// Fill `node` (a .message) for `message`; index: its place in chat.messages.
function drawMessage(node, message, index) {
  node.replaceChildren();
  node.className = `message ${message.error ? "error" : message.role}`;
  node.dataset.index = index;
  if (message.error) {
    node.append(element("div", "bubble", message.content));
    return;
  }
  const bubble = element("div", "bubble");
  if (message.reasoning) {
    const details = element("details", "reasoning");
    details.open = message.thinking === true; // open while the model is still thinking
    details.append(element("summary", null, message.thinking ? "Thinking…" : "Thought"));
    details.append(element("div", "reasoning-text", message.reasoning));
    bubble.append(details);
  }
  const content = element("div", "content");
  if (message.role === "assistant") content.append(renderMarkdown(message.content));
  else content.textContent = message.content;
  bubble.append(content);
  if (message.role === "assistant" && chat.running && chat.running.message === message)
    bubble.append(element("span", "cursor"));
  node.append(bubble);
  if (message.role !== "assistant" || (chat.running && chat.running.message === message)) return;
  const footer = element("div", "message-footer");
  footer.append(element("span", "stats", statsLine(message.stats)));
  const copy = element("button", "ghost small copy", "Copy");
  copy.type = "button";
  copy.addEventListener("click", () =>
    navigator.clipboard.writeText(message.content).then(() => (copy.textContent = "Copied")),
  );
  footer.append(copy);
  if (index === chat.messages.length - 1) {
    const again = element("button", "ghost small regenerate", "Regenerate");
    again.type = "button";
    again.addEventListener("click", regenerate);
    footer.append(again);
  }
  node.append(footer);
}

function drawAll() {
  const list = $("messages");
  list.querySelectorAll(".message").forEach((node) => node.remove());
  $("empty").hidden = chat.messages.length > 0;
  chat.messages.forEach((message, index) => {
    const node = element("div");
    drawMessage(node, message, index);
    list.append(node);
  });
  list.scrollTop = list.scrollHeight;
}

function redraw(message) {
  const index = chat.messages.indexOf(message);
  const node = $("messages").querySelector(`.message[data-index="${index}"]`);
  if (!node) return drawAll();
  const list = $("messages");
  const atBottom = list.scrollHeight - list.scrollTop - list.clientHeight < 40;
  drawMessage(node, message, index);
  if (atBottom) list.scrollTop = list.scrollHeight;
}

// --- sending --------------------------------------------------------------------------

function setRunning(running) {
  chat.running = running;
  $("send").hidden = Boolean(running);
  $("stop").hidden = !running;
}

// Stream the assistant's answer to the conversation as it stands.
async function answer() {
  const body = requestBody(chat.messages);
  const message = { role: "assistant", content: "", reasoning: "", thinking: false };
  chat.messages.push(message);
  const controller = new AbortController();
  setRunning({ message, controller });
  drawAll();
  const start = performance.now();
  let first = null;
  let scheduled = false;
  const show = () => {
    if (scheduled) return;
    scheduled = true;
    requestAnimationFrame(() => {
      scheduled = false;
      redraw(message);
    });
  };
  message.stats = {};
  try {
    const response = await request("POST", "/v1/chat/completions", body, controller.signal);
    for await (const chunk of events(response)) {
      if (chunk.usage) message.stats.tokens = chunk.usage.completion_tokens;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      const delta = choice.delta || {};
      if (delta.reasoning_content || delta.content) {
        first ??= performance.now();
        message.thinking = Boolean(delta.reasoning_content) && !delta.content;
      }
      if (delta.reasoning_content) message.reasoning += delta.reasoning_content;
      if (delta.content) message.content += delta.content;
      if (choice.finish_reason) message.stats.finish = choice.finish_reason;
      show();
    }
  } catch (error) {
    if (error.name === "AbortError") message.stats.stopped = true;
    else {
      chat.messages.push({
        role: "assistant",
        error: true,
        content: error instanceof APIError ? `Error: ${error.message}` : `Error: ${error}`,
      });
    }
  } finally {
    const end = performance.now();
    message.thinking = false;
    if (first !== null) {
      message.stats.ttft = (first - start) / 1000;
      // Tokens after the first, over the time after the first: the decode speed.
      if (message.stats.tokens > 1 && end > first)
        message.stats.tokensPerSecond = ((message.stats.tokens - 1) * 1000) / (end - first);
    }
    if (!message.content && !message.reasoning && !message.stats.stopped)
      chat.messages.splice(chat.messages.indexOf(message), 1); // failed before any text
    setRunning(null);
    saveMessages();
    drawAll();
  }
}

function send(event) {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || chat.running) return;
  $("prompt").value = "";
  chat.messages.push({ role: "user", content: text });
  saveMessages();
  answer();
}

function regenerate() {
  if (chat.running) return;
  while (chat.messages.length && chat.messages.at(-1).role === "assistant") chat.messages.pop();
  if (chat.messages.length) answer();
  else drawAll();
}

function newChat() {
  if (chat.running) chat.running.controller.abort();
  chat.messages = [];
  saveMessages();
  drawAll();
  $("prompt").focus();
}

loadSettings();
setUpPage();
$("composer").addEventListener("submit", send);
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) send(event);
});
$("stop").addEventListener("click", () => chat.running && chat.running.controller.abort());
$("new-chat").addEventListener("click", newChat);
drawAll();
