// The chat page: a conversation with the served model over /v1/chat/completions (SSE).
//
// The conversations live in conversations.js (localStorage); the one on the page is
// `chats.current.messages` ({role, content, images?, reasoning?, stats?, error?}; images:
// a user message's data URLs, sent as OpenAI image_url parts before its text). Each answer
// streams in; its reasoning (Qwen3's <think> block, split by the server into
// reasoning_content) shows in a collapsible block; Stop aborts the fetch, which closes
// the connection, and the server aborts the request. A failed answer leaves an error
// message with Retry (the same as Regenerate: the answer is asked for again).

import { APIError, events, request, setUpPage } from "./api.js";
import { Conversations } from "./conversations.js";
import { renderMarkdown } from "./markdown.js";
import { element } from "./dom.js";

const SETTINGS_STORAGE = "qinfer.chatSettings";
const SETTINGS = ["system", "temperature", "top-p", "max-tokens", "thinking"];

const $ = (id) => document.getElementById(id);
const chats = new Conversations();
const chat = { running: null, images: [] }; // images: attached to the next message
const messages = () => chats.current.messages;

// --- settings -------------------------------------------------------------------------
// The fields start at the page's chat defaults (chat.html's values: temperature 0.7,
// top-p 0.9, 1024 tokens), which the page sends; an emptied field is left to the server.

function loadSettings() {
  let saved = {};
  try {
    saved = JSON.parse(localStorage.getItem(SETTINGS_STORAGE)) || {};
  } catch {
    // unreadable: the defaults
  }
  for (const id of SETTINGS) {
    if (saved[id] !== undefined) $(id).value = saved[id];
    $(id).addEventListener("change", saveSettings);
  }
}

function saveSettings() {
  const values = Object.fromEntries(SETTINGS.map((id) => [id, $(id).value]));
  localStorage.setItem(SETTINGS_STORAGE, JSON.stringify(values));
}

function resetSettings() {
  for (const id of SETTINGS) {
    const field = $(id);
    field.value = field.tagName === "SELECT" ? "" : field.defaultValue;
  }
  saveSettings();
}

// The request body for the conversation so far (errors and the answer being made left out).
function requestBody(conversation) {
  const body = { messages: [], stream: true, stream_options: { include_usage: true } };
  const system = $("system").value.trim();
  if (system) body.messages.push({ role: "system", content: system });
  for (const message of conversation) {
    if (!message.error) body.messages.push({ role: message.role, content: contentOf(message) });
  }
  const number = (id) => ($(id).value === "" ? undefined : Number($(id).value));
  if (number("temperature") !== undefined) body.temperature = number("temperature");
  if (number("top-p") !== undefined) body.top_p = number("top-p");
  if (number("max-tokens") !== undefined) body.max_tokens = number("max-tokens");
  if (!$("thinking-setting").hidden && $("thinking").value)
    body.chat_template_kwargs = { enable_thinking: $("thinking").value === "on" };
  return body;
}

// A message's content as the API takes it: its text, or its images' parts then the text.
function contentOf(message) {
  if (!message.images || !message.images.length) return message.content;
  const parts = message.images.map((url) => ({ type: "image_url", image_url: { url } }));
  if (message.content) parts.push({ type: "text", text: message.content });
  return parts;
}

// --- attaching images -----------------------------------------------------------------
// Chosen with the + button (a file input) or pasted into the message box; read as data
// URLs, shown above the box until the next message takes them.

function readImage(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

async function attach(files) {
  const images = [...files].filter((file) => file.type.startsWith("image/"));
  for (const url of await Promise.all(images.map(readImage))) chat.images.push(url);
  drawAttachments();
}

function drawAttachments() {
  const list = $("attachments");
  list.hidden = !chat.images.length;
  list.replaceChildren();
  chat.images.forEach((url, index) => {
    const item = element("li");
    const image = element("img", "thumbnail");
    image.src = url;
    image.alt = `Attached image ${index + 1}`;
    const remove = smallButton("remove-image", "✕", () => {
      chat.images.splice(index, 1);
      drawAttachments();
      $("prompt").focus();
    });
    remove.setAttribute("aria-label", `Remove image ${index + 1}`);
    item.append(image, remove);
    list.append(item);
  });
}

// The thumbnails of a user message's images, in its bubble.
function messageImages(images) {
  const row = element("div", "images");
  images.forEach((url, index) => {
    const image = element("img", "thumbnail");
    image.src = url;
    image.alt = `Image ${index + 1}`;
    row.append(image);
  });
  return row;
}

// --- the drawer and the history of conversations --------------------------------------

function setDrawer(open) {
  document.body.classList.toggle("drawer-open", open);
  if (!open) $("prompt").focus();
}

function drawHistory() {
  const list = $("history");
  list.replaceChildren();
  for (const entry of chats.listed()) {
    const item = element("li", entry.id === chats.current.id ? "current" : null);
    const open = element("button", "chat-title", chats.title(entry));
    open.type = "button";
    open.title = chats.title(entry);
    open.addEventListener("click", () => switchChat(entry.id));
    const rename = element("button", "ghost small rename", "✎");
    rename.type = "button";
    rename.title = "Rename";
    rename.setAttribute("aria-label", "Rename");
    rename.addEventListener("click", () => startRename(item, entry));
    const remove = element("button", "ghost small delete", "✕");
    remove.type = "button";
    remove.title = "Delete";
    remove.setAttribute("aria-label", "Delete");
    remove.addEventListener("click", () => {
      if (entry.id === chats.current.id) stopAnswer();
      chats.remove(entry.id);
      drawAll();
    });
    item.append(open, rename, remove);
    list.append(item);
  }
}

// The title becomes a field: Enter or leaving it keeps the new name, Escape does not.
function startRename(item, entry) {
  const field = element("input", "rename-field");
  field.value = chats.title(entry);
  field.setAttribute("aria-label", "Conversation name");
  let done = false;
  const finish = (keep) => {
    if (done) return;
    done = true;
    if (keep) chats.rename(entry.id, field.value);
    drawHistory();
  };
  field.addEventListener("keydown", (event) => {
    if (event.key === "Enter") finish(true);
    if (event.key === "Escape") finish(false);
  });
  field.addEventListener("blur", () => finish(true));
  item.replaceChildren(field);
  field.focus();
  field.select();
}

function stopAnswer() {
  if (chat.running) chat.running.controller.abort();
}

function switchChat(id) {
  stopAnswer();
  chats.switchTo(id);
  drawAll();
  setDrawer(false);
}

function newChat() {
  stopAnswer();
  chats.start();
  drawAll();
  setDrawer(false);
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

function smallButton(className, label, onClick) {
  const button = element("button", `ghost small ${className}`, label);
  button.type = "button";
  button.addEventListener("click", onClick);
  return button;
}

// Fill `node` (a .message) for `message`; index: its place in the conversation.
function drawMessage(node, message, index) {
  node.replaceChildren();
  node.className = `message ${message.error ? "error" : message.role}`;
  node.dataset.index = index;
  // The answer to ask for again: the last one, or the last before errors only.
  const last = messages()
    .slice(index + 1)
    .every((later) => later.error);
  if (message.error) {
    const bubble = element("div", "bubble", message.content);
    if (index === messages().length - 1 && !chat.running)
      bubble.append(smallButton("retry", "Retry", regenerate));
    node.append(bubble);
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
  if (message.images && message.images.length) bubble.append(messageImages(message.images));
  const content = element("div", "content");
  if (message.role === "assistant") content.append(renderMarkdown(message.content));
  else content.textContent = message.content;
  bubble.append(content);
  const streaming = chat.running && chat.running.message === message;
  if (streaming) bubble.append(element("span", "cursor"));
  node.append(bubble);
  if (message.role !== "assistant" || streaming) return;
  const footer = element("div", "message-footer");
  footer.append(element("span", "stats", statsLine(message.stats)));
  const copy = smallButton("copy", "Copy", () =>
    navigator.clipboard.writeText(message.content).then(() => (copy.textContent = "Copied")),
  );
  footer.append(copy);
  if (last && !chat.running) footer.append(smallButton("regenerate", "Regenerate", regenerate));
  node.append(footer);
}

function drawAll() {
  const list = $("messages");
  list.querySelectorAll(".message").forEach((node) => node.remove());
  $("empty").hidden = messages().length > 0;
  messages().forEach((message, index) => {
    const node = element("div");
    drawMessage(node, message, index);
    list.append(node);
  });
  list.scrollTop = list.scrollHeight;
  drawHistory();
}

function redraw(message) {
  const index = messages().indexOf(message);
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

// What a failed answer says: the server's own message, or what to do when it is gone.
function errorText(error) {
  if (!(error instanceof APIError)) return `Error: ${error}`;
  if (error.status === 0) return `${error.message} Is qinfer serve still running?`;
  return `Error: ${error.message}`;
}

// Stream the assistant's answer to the conversation as it stands.
async function answer() {
  const conversation = messages();
  const body = requestBody(conversation);
  const message = { role: "assistant", content: "", reasoning: "", thinking: false };
  conversation.push(message);
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
      if (conversation === messages()) redraw(message);
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
    else conversation.push({ role: "assistant", error: true, content: errorText(error) });
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
      conversation.splice(conversation.indexOf(message), 1); // failed before any text
    setRunning(null);
    chats.save(conversation === messages());
    drawAll();
    // The Stop button that had the focus is hidden now: the message box takes it back.
    const focused = document.activeElement;
    if (!focused || focused === document.body || focused.id === "stop") $("prompt").focus();
  }
}

function send(event) {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if ((!text && !chat.images.length) || chat.running) return;
  $("prompt").value = "";
  fitPrompt();
  const message = { role: "user", content: text };
  if (chat.images.length) message.images = chat.images.splice(0);
  drawAttachments();
  messages().push(message);
  chats.save();
  answer();
}

// Ask again for the last answer (Regenerate, Retry): the answers and errors after the
// last user message go.
function regenerate() {
  if (chat.running) return;
  const conversation = messages();
  while (conversation.length && conversation.at(-1).role === "assistant") conversation.pop();
  if (conversation.length) answer();
  else drawAll();
}

// The message box grows with its text (up to the stylesheet's max-height, then scrolls).
function fitPrompt() {
  const box = $("prompt");
  box.style.height = "auto";
  box.style.height = `${box.scrollHeight + box.offsetHeight - box.clientHeight}px`;
}

loadSettings();
setUpPage((model) => ($("thinking-setting").hidden = !model.thinking));
$("composer").addEventListener("submit", send);
$("prompt").addEventListener("keydown", (event) => {
  // Enter that ends an input method's composition (Japanese, Chinese, ...) picks the
  // characters; it must not send. keyCode 229 is how some browsers mark it.
  if (event.isComposing || event.keyCode === 229) return;
  if (event.key === "Enter" && !event.shiftKey) send(event);
});
$("prompt").addEventListener("input", fitPrompt);
$("prompt").addEventListener("paste", (event) => {
  const files = [...event.clipboardData.files].filter((file) => file.type.startsWith("image/"));
  if (!files.length) return; // text pastes as text
  event.preventDefault();
  attach(files);
});
$("attach").addEventListener("click", () => $("image-input").click());
$("image-input").addEventListener("change", (event) => {
  attach(event.target.files).finally(() => (event.target.value = "")); // the same file again
  $("prompt").focus();
});
$("stop").addEventListener("click", () => {
  stopAnswer();
  $("prompt").focus();
});
$("new-chat").addEventListener("click", newChat);
$("reset-settings").addEventListener("click", resetSettings);
$("drawer-button").addEventListener("click", () => setDrawer(true));
$("drawer-close").addEventListener("click", () => setDrawer(false));
$("drawer-backdrop").addEventListener("click", () => setDrawer(false));
document.addEventListener("keydown", (event) => {
  if (event.key === "Escape" && document.body.classList.contains("drawer-open")) setDrawer(false);
});
drawAll();
$("prompt").focus();
