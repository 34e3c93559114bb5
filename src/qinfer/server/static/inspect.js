// The attention inspector: POST /v1/inspect for one prompt and one layer, then draw the
// token strip, every head's attention as a thumbnail, the chosen head's heatmap, the
// next-token bars of the chosen position, and the logit lens (layers x positions).

import { postJSON, setUpPage } from "./api.js";
import { element, tokenLabel } from "./dom.js";

const $ = (id) => document.getElementById(id);
const view = { data: null, head: 0, position: 0 };

// Viridis at five stops, weight 0 -> 1; qinfer/analysis/heatmap.py draws the PNG with the same.
const STOPS = [
  [68, 1, 84],
  [59, 82, 139],
  [33, 145, 140],
  [94, 201, 98],
  [253, 231, 37],
];
const MASKED = [226, 229, 234]; // keys after the query: the causal mask hides them

function color(weight) {
  const x = Math.min(Math.max(weight, 0), 1) * (STOPS.length - 1);
  const i = Math.min(Math.floor(x), STOPS.length - 2);
  const t = x - i;
  return STOPS[i].map((c, k) => Math.round(c + (STOPS[i + 1][k] - c) * t));
}

// Paint an L x L matrix into a canvas, one `cell`-pixel square per weight, at (x0, y0).
function paintMatrix(context, matrix, x0, y0, cell) {
  const L = matrix.length;
  const image = context.createImageData(L * cell, L * cell);
  for (let i = 0; i < L; i++) {
    for (let j = 0; j < L; j++) {
      const rgb = j > i ? MASKED : color(matrix[i][j]);
      for (let dy = 0; dy < cell; dy++) {
        for (let dx = 0; dx < cell; dx++) {
          const p = ((i * cell + dy) * L * cell + j * cell + dx) * 4;
          image.data.set([...rgb, 255], p);
        }
      }
    }
  }
  context.putImageData(image, x0, y0);
}

function drawHeatmap() {
  const { data, head, position } = view;
  const attention = data.attention[0];
  const matrix = attention.weights[head];
  const labels = data.tokens.map((token) => tokenLabel(token.text));
  const L = matrix.length;
  const canvas = $("heatmap");
  const context = canvas.getContext("2d");
  context.font = "12px ui-monospace, Menlo, Consolas, monospace";
  const margin = Math.min(140, 12 + Math.max(...labels.map((label) => context.measureText(label).width)));
  const cell = Math.max(4, Math.min(36, Math.floor(560 / L)));
  canvas.width = margin + L * cell + 8;
  canvas.height = margin + L * cell + 8;
  context.font = "12px ui-monospace, Menlo, Consolas, monospace";
  context.fillStyle = getComputedStyle(document.body).getPropertyValue("--panel") || "#fff";
  context.fillRect(0, 0, canvas.width, canvas.height);
  paintMatrix(context, matrix, margin, margin, cell);
  // The chosen query's row, outlined.
  context.strokeStyle = "#e8590c";
  context.lineWidth = 2;
  context.strokeRect(margin, margin + position * cell, L * cell, cell);
  if (cell >= 9) {
    context.fillStyle = getComputedStyle(document.body).getPropertyValue("--text") || "#000";
    context.textBaseline = "middle";
    labels.forEach((label, i) => {
      const short = label.length > 16 ? `${label.slice(0, 15)}…` : label;
      context.textAlign = "right";
      context.fillText(short, margin - 6, margin + (i + 0.5) * cell); // query rows
      context.save();
      context.translate(margin + (i + 0.5) * cell, margin - 6);
      context.rotate(-Math.PI / 2);
      context.textAlign = "left";
      context.fillText(short, 0, 0); // key columns
      context.restore();
    });
  }
  $("attention-title").replaceChildren(
    `Attention · layer ${attention.layer} · head ${attention.heads[head]}`,
    element("span", "sub", `query head ${attention.heads[head]} reads KV head ${Math.floor(attention.heads[head] / (data.num_heads / data.num_kv_heads))}`),
  );
  for (const thumb of $("heads").children) thumb.classList.toggle("selected", Number(thumb.dataset.head) === head);
}

function drawHeads() {
  const attention = view.data.attention[0];
  $("heads").replaceChildren();
  attention.weights.forEach((matrix, index) => {
    const thumb = element("button", "head-thumb");
    thumb.type = "button";
    thumb.dataset.head = index;
    const canvas = element("canvas");
    canvas.width = canvas.height = matrix.length;
    paintMatrix(canvas.getContext("2d"), matrix, 0, 0, 1);
    thumb.append(canvas, element("div", null, `head ${attention.heads[index]}`));
    thumb.addEventListener("click", () => {
      view.head = index;
      drawHeatmap();
    });
    $("heads").append(thumb);
  });
}

function drawTokens() {
  $("tokens").replaceChildren();
  view.data.tokens.forEach((token, index) => {
    const chip = element("button", "token", tokenLabel(token.text));
    chip.type = "button";
    chip.title = `position ${index}, id ${token.id}`;
    chip.append(element("span", "id", String(token.id)));
    chip.classList.toggle("selected", index === view.position);
    chip.addEventListener("click", () => choosePosition(index));
    $("tokens").append(chip);
  });
}

function drawBars() {
  const { data, position } = view;
  const after = tokenLabel(data.tokens[position].text);
  $("next-title").replaceChildren("Next token ", element("span", "sub", `after position ${position} (“${after}”)`));
  $("bars").replaceChildren();
  for (const candidate of data.next_tokens[position]) {
    const bar = element("div", "bar");
    bar.style.width = `${(candidate.prob * 100).toFixed(1)}%`;
    const track = element("div");
    track.append(bar);
    $("bars").append(
      element("span", "bar-label", tokenLabel(candidate.text)),
      track,
      element("span", "bar-value", `${(candidate.prob * 100).toFixed(1)}%`),
    );
  }
}

function drawLens() {
  const { data, position } = view;
  const table = $("lens");
  table.replaceChildren();
  const head = element("tr");
  head.append(element("th", null, "layer"));
  data.tokens.forEach((token) => head.append(element("th", null, tokenLabel(token.text))));
  table.append(head);
  data.logit_lens.forEach((positions, layer) => {
    const row = element("tr");
    row.append(element("th", null, String(layer)));
    positions.forEach((candidates, index) => {
      const top = candidates[0];
      const cell = element("td", index === position ? "selected-column" : null, tokenLabel(top.text));
      cell.title = candidates.map((c) => `${tokenLabel(c.text)} ${(c.prob * 100).toFixed(1)}%`).join("\n");
      cell.style.background = `rgba(59, 91, 219, ${(0.08 + 0.7 * top.prob).toFixed(3)})`;
      row.append(cell);
    });
    table.append(row);
  });
}

function choosePosition(index) {
  view.position = index;
  for (const [i, chip] of [...$("tokens").children].entries()) chip.classList.toggle("selected", i === index);
  drawHeatmap();
  drawBars();
  drawLens();
}

function fillLayerPicker(count) {
  const picker = $("layer");
  if (picker.options.length === count) return;
  const chosen = picker.value;
  picker.replaceChildren();
  for (let layer = 0; layer < count; layer++) picker.append(new Option(String(layer), String(layer)));
  picker.value = chosen;
}

function drawLegend() {
  const canvas = $("legend");
  const context = canvas.getContext("2d");
  for (let x = 0; x < canvas.width; x++) {
    context.fillStyle = `rgb(${color(x / (canvas.width - 1)).join(",")})`;
    context.fillRect(x, 0, 1, canvas.height);
  }
}

async function inspect(event) {
  if (event) event.preventDefault();
  const text = $("prompt").value;
  const body = {
    prompt: $("mode").value === "chat" ? [{ role: "user", content: text }] : text,
    layers: [Number($("layer").value)],
    top_k: Number($("top-k").value),
  };
  $("status").className = "status";
  $("status").textContent = "Running the prompt through the model…";
  $("inspect").disabled = true;
  const start = performance.now();
  try {
    const data = await postJSON("/v1/inspect", body);
    view.data = data;
    view.head = Math.min(view.head, data.attention[0].heads.length - 1);
    view.position = data.tokens.length - 1;
    fillLayerPicker(data.num_layers);
    $("results").hidden = false;
    drawTokens();
    drawHeads();
    choosePosition(view.position);
    const seconds = ((performance.now() - start) / 1000).toFixed(2);
    $("status").textContent = `${data.tokens.length} tokens · ${data.num_layers} layers · ${data.num_heads} query heads over ${data.num_kv_heads} KV heads · ${seconds} s`;
  } catch (error) {
    $("status").className = "status error";
    $("status").textContent = `Error: ${error.message}`;
  } finally {
    $("inspect").disabled = false;
  }
}

drawLegend();
setUpPage();
$("inspect-form").addEventListener("submit", inspect);
$("layer").addEventListener("change", () => view.data && inspect());
