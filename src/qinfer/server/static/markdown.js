// A small Markdown renderer for model answers that builds DOM nodes and sets only
// textContent: whatever the model or the user writes stays text (a "<script>" in an
// answer shows as those characters and never runs). Covers what chat answers use:
// fenced code blocks (coloured by syntax.js), headings, lists (nested by indentation,
// numbered from their first number), pipe tables, block quotes, rules, paragraphs, and
// inline code, bold, italics and http(s) links.

import { element } from "./dom.js";
import { codeElement } from "./syntax.js";

// Inline spans: `code`, **bold**, *italic* / _italic_, [text](http...). Unclosed marks
// stay as typed (a stream shows "**bo" until its closing "**" arrives).
const INLINE = /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)|\*\*([^*]+)\*\*|\*([^*\s][^*]*)\*|\b_([^_]+)_\b|\[([^\]]+)\]\((https?:\/\/[^\s)]+)\)/g;

function appendInline(parent, text) {
  let last = 0;
  for (const match of text.matchAll(INLINE)) {
    if (match.index > last) parent.append(text.slice(last, match.index));
    const [, , code, bold, italic, underscored, label, url] = match;
    if (code !== undefined) parent.append(element("code", "inline-code", code));
    else if (bold !== undefined) parent.append(element("strong", null, bold));
    else if (italic !== undefined || underscored !== undefined)
      parent.append(element("em", null, italic ?? underscored));
    else {
      const link = element("a", null, label);
      link.href = url; // only http(s) matches the pattern: no javascript: URLs
      link.target = "_blank";
      link.rel = "noopener noreferrer";
      parent.append(link);
    }
    last = match.index + match[0].length;
  }
  if (last < text.length) parent.append(text.slice(last));
}

function codeBlock(language, code) {
  const figure = element("figure", "code-block");
  const bar = element("div", "code-bar");
  bar.append(element("span", "code-language", language || "text"));
  const copy = element("button", "copy-code", "Copy");
  copy.type = "button";
  copy.addEventListener("click", () => {
    navigator.clipboard.writeText(code).then(() => {
      copy.textContent = "Copied";
      setTimeout(() => (copy.textContent = "Copy"), 1200);
    });
  });
  bar.append(copy);
  const pre = element("pre");
  pre.append(codeElement(language, code));
  figure.append(bar, pre);
  return figure;
}

const FENCE = /^\s*(```|~~~)\s*([\w+#.-]*)\s*$/;
const HEADING = /^(#{1,6})\s+(.*)$/;
// A list item: [, indent, marker, its number (numbered items), text].
const ITEM = /^( *)([-*+]|(\d{1,9})[.)])\s+(.*)$/;
const QUOTE = /^\s*>\s?(.*)$/;
const RULE = /^ {0,3}([-*_])( *\1){2,} *$/;
// A table's second line: | --- | :-: | ---: | (the pipes at the ends optional).
const TABLE_DELIMITER = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

const indentOf = (line) => line.length - line.trimStart().length;
const isBlank = (line) => !line.trim();

function isTable(lines, i) {
  return (
    lines[i].includes("|") &&
    i + 1 < lines.length &&
    lines[i + 1].includes("|") &&
    TABLE_DELIMITER.test(lines[i + 1])
  );
}

// Whether lines[i] starts a block other than a paragraph.
function startsBlock(lines, i) {
  const line = lines[i];
  return (
    FENCE.test(line) ||
    HEADING.test(line) ||
    ITEM.test(line) ||
    QUOTE.test(line) ||
    RULE.test(line) ||
    isTable(lines, i)
  );
}

// A table row's cells: split at the pipes that are not escaped as "\|".
function cells(line) {
  let text = line.trim();
  if (text.startsWith("|")) text = text.slice(1);
  if (text.endsWith("|") && !text.endsWith("\\|")) text = text.slice(0, -1);
  return text.split(/(?<!\\)\|/).map((cell) => cell.trim().replace(/\\\|/g, "|"));
}

function tableCell(tag, text, align) {
  const node = element(tag);
  if (align) node.style.textAlign = align;
  appendInline(node, text);
  return node;
}

// The table starting at lines[i] (header, delimiter, rows up to a line without a pipe),
// in a box that scrolls sideways when it is wider than the answer; [node, next line].
function table(lines, i) {
  const header = cells(lines[i]);
  const aligns = cells(lines[i + 1]).map((rule) => {
    if (rule.endsWith(":")) return rule.startsWith(":") ? "center" : "right";
    return rule.startsWith(":") ? "left" : "";
  });
  const head = element("tr");
  header.forEach((text, k) => head.append(tableCell("th", text, aligns[k])));
  const thead = element("thead");
  thead.append(head);
  const tbody = element("tbody");
  i += 2;
  while (i < lines.length && !isBlank(lines[i]) && lines[i].includes("|")) {
    const values = cells(lines[i++]);
    const row = element("tr");
    header.forEach((_, k) => row.append(tableCell("td", values[k] ?? "", aligns[k])));
    tbody.append(row);
  }
  const node = element("table");
  node.append(thead, tbody);
  const wrap = element("div", "table-wrap");
  wrap.append(node);
  return [wrap, i];
}

// The list starting at lines[i]: the items of its first item's kind (bullets or numbers)
// at its indent. The lines indented past an item's marker (blank lines between them
// included) are the item's own blocks, nested lists among them; blank lines between two
// items keep one list. A numbered list starts at its first number, so a list broken by
// other blocks still counts on ("1." ... "2." stays 2). [node, next line].
function list(lines, i) {
  const first = lines[i].match(ITEM);
  const indent = first[1].length;
  const numbered = first[3] !== undefined;
  const node = element(numbered ? "ol" : "ul");
  if (numbered && Number(first[3]) !== 1) node.start = Number(first[3]);
  const sameList = (line) => {
    const item = line.match(ITEM);
    return item && item[1].length === indent && (item[3] !== undefined) === numbered;
  };
  const nextFilled = (j) => {
    while (j < lines.length && isBlank(lines[j])) j += 1;
    return j;
  };
  while (i < lines.length && sameList(lines[i])) {
    const text = lines[i].match(ITEM)[4];
    i += 1;
    const body = [];
    while (i < lines.length) {
      const next = nextFilled(i);
      if (next >= lines.length || indentOf(lines[next]) <= indent) break;
      while (i <= next) body.push(lines[i++]);
    }
    const item = element("li");
    appendInline(item, text);
    if (body.length) {
      const cut = Math.min(...body.filter((line) => !isBlank(line)).map(indentOf));
      item.append(renderMarkdown(body.map((line) => line.slice(cut)).join("\n")));
    }
    node.append(item);
    const next = nextFilled(i);
    if (next < lines.length && sameList(lines[next])) i = next;
  }
  return [node, i];
}

// A DocumentFragment showing `text` as Markdown.
export function renderMarkdown(text) {
  const out = document.createDocumentFragment();
  const lines = text.replace(/\t/g, "    ").split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(FENCE);
    if (fence) {
      const body = [];
      i += 1;
      while (i < lines.length && !lines[i].trim().startsWith(fence[1])) body.push(lines[i++]);
      i += 1; // the closing fence (absent while the block still streams)
      out.append(codeBlock(fence[2], body.join("\n")));
      continue;
    }
    const heading = line.match(HEADING);
    if (heading) {
      const node = element(`h${Math.min(heading[1].length + 2, 6)}`);
      appendInline(node, heading[2]);
      out.append(node);
      i += 1;
      continue;
    }
    if (RULE.test(line)) {
      out.append(element("hr"));
      i += 1;
      continue;
    }
    if (isTable(lines, i) || ITEM.test(line)) {
      const [node, next] = (ITEM.test(line) ? list : table)(lines, i);
      out.append(node);
      i = next;
      continue;
    }
    if (QUOTE.test(line)) {
      const quote = element("blockquote");
      const quoted = [];
      while (i < lines.length && QUOTE.test(lines[i])) quoted.push(lines[i++].match(QUOTE)[1]);
      quote.append(renderMarkdown(quoted.join("\n")));
      out.append(quote);
      continue;
    }
    if (isBlank(line)) {
      i += 1;
      continue;
    }
    // A paragraph: lines up to a blank line or the start of another block.
    const paragraph = element("p");
    const body = [line];
    i += 1;
    while (i < lines.length && !isBlank(lines[i]) && !startsBlock(lines, i)) body.push(lines[i++]);
    body.forEach((part, n) => {
      if (n) paragraph.append(element("br"));
      appendInline(paragraph, part);
    });
    out.append(paragraph);
  }
  return out;
}
