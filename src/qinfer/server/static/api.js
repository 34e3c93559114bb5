// Talking to the server's /v1 API from the pages: the API key, JSON requests, errors, and
// server-sent events. The key is asked for once (when the server answers 401) and kept in
// localStorage; it is sent as "Authorization: Bearer <key>", as the OpenAI clients do.
// `setUpPage` draws every page's header, with the served model and the key bar.

const KEY_STORAGE = "qinfer.apiKey";

export class APIError extends Error {
  // status: the HTTP status (0 when the server could not be reached).
  constructor(message, status) {
    super(message);
    this.status = status;
  }
}

function apiKey() {
  return localStorage.getItem(KEY_STORAGE) || "";
}

function headers() {
  const result = { "Content-Type": "application/json" };
  if (apiKey()) result.Authorization = `Bearer ${apiKey()}`;
  return result;
}

// The one-line message of an error response ({"error": {"message": ...}}, OpenAI's shape).
async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch {
    // not JSON: the status line says it
  }
  if (response.status === 401) showKeyBar(message);
  return new APIError(message, response.status);
}

// fetch() with the key; a non-2xx answer throws APIError with the server's message.
export async function request(method, path, body, signal) {
  let response;
  try {
    response = await fetch(path, {
      method,
      headers: headers(),
      body: body === undefined ? undefined : JSON.stringify(body),
      signal,
    });
  } catch (error) {
    if (error.name === "AbortError") throw error;
    throw new APIError("Could not reach the server.", 0);
  }
  if (!response.ok) throw await errorOf(response);
  return response;
}

async function getJSON(path) {
  return (await request("GET", path)).json();
}

export async function postJSON(path, body, signal) {
  return (await request("POST", path, body, signal)).json();
}

// The JSON payloads of a text/event-stream, until "[DONE]". An {"error": ...} event (a
// failure after the stream began) throws APIError; so does a stream cut before "[DONE]"
// (status 0: the server went away).
export async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  const lost = new APIError("The connection to the server was lost before the answer ended.", 0);
  let buffer = "";
  for (;;) {
    let chunk;
    try {
      chunk = await reader.read();
    } catch (error) {
      if (error.name === "AbortError") throw error;
      throw lost;
    }
    const { value, done } = chunk;
    if (done) throw lost;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""))
        .join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      const payload = JSON.parse(data);
      if (payload.error) throw new APIError(payload.error.message, 500);
      yield payload;
    }
  }
}

// The bar at the top of every page that asks for the API key (shown after a 401).
function showKeyBar(reason) {
  const bar = document.getElementById("key-bar");
  if (!bar) return;
  bar.hidden = false;
  bar.querySelector(".key-reason").textContent = reason || "This server needs an API key.";
  const input = bar.querySelector("input");
  input.value = apiKey();
  input.focus();
}

// The header of every page (the pages, the served model, the key button) and the key bar
// under it. A constant: nothing from the server or the model goes through innerHTML.
const HEADER = `
  <header class="top">
    <span class="brand">qinfer</span>
    <nav>
      <a href="/">Chat</a>
      <a href="/inspect">Inspector</a>
      <a href="/docs">API</a>
    </nav>
    <span id="model-name" class="model-name">…</span>
    <button id="key-button" type="button" class="ghost" title="Set the API key">Key</button>
  </header>
  <div id="key-bar" class="key-bar" hidden>
    <form>
      <span class="key-reason"></span>
      <input type="password" name="key" placeholder="API key" autocomplete="off" aria-label="API key">
      <button type="submit">Save key</button>
    </form>
  </div>`;

// Draw the header and the key bar at the top of the page, mark the page's own link, and
// show the served model (asking for the key if the server wants one). onModel, if given,
// gets the model's /v1/models entry ({id, thinking, ...}) once the server names it.
export function setUpPage(onModel) {
  document.body.insertAdjacentHTML("afterbegin", HEADER);
  for (const link of document.querySelectorAll("header.top nav a")) {
    if (link.getAttribute("href") === location.pathname) link.classList.add("current");
  }
  const show = () => showModelName(onModel);
  setUpKeyBar(show);
  show();
}

// Wire the key bar's form; onSaved runs after a new key is stored.
function setUpKeyBar(onSaved) {
  const bar = document.getElementById("key-bar");
  bar.querySelector("form").addEventListener("submit", (event) => {
    event.preventDefault();
    localStorage.setItem(KEY_STORAGE, bar.querySelector("input").value.trim());
    bar.hidden = true;
    onSaved();
  });
  document.getElementById("key-button").addEventListener("click", () => showKeyBar("API key"));
}

// The served model's id (GET /v1/models), shown in the header; its entry goes to onModel.
async function showModelName(onModel) {
  const label = document.getElementById("model-name");
  try {
    const model = (await getJSON("/v1/models")).data[0];
    label.textContent = label.title = model.id;
    if (onModel) onModel(model);
  } catch (error) {
    label.textContent = error.status === 401 ? "API key needed" : "server unreachable";
  }
}
