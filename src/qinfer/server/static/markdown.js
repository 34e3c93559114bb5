// A small Markdown renderer for model answers that builds DOM nodes and sets only
// textContent: whatever the model or the user writes stays text (a "<script>" in an
// answer shows as those characters and never runs). Covers what chat answers use:
// fenced code blocks, headings, lists, block quotes, paragraphs, and inline code, bold,
// italics and http(s) links.

import { element } from "./dom.js";

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
  pre.append(element("code", null, code));
  figure.append(bar, pre);
  return figure;
}

const FENCE = /^\s*(```|~~~)\s*([\w+#.-]*)\s*$/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const BULLET = /^\s*[-*+]\s+(.*)$/;
const NUMBERED = /^\s*\d+[.)]\s+(.*)$/;
const QUOTE = /^\s*>\s?(.*)$/;

// A DocumentFragment showing `text` as Markdown.
export function renderMarkdown(text) {
  const out = document.createDocumentFragment();
  const lines = text.split("\n");
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
    const listTag = BULLET.test(line) ? "ul" : NUMBERED.test(line) ? "ol" : null;
    if (listTag) {
      const pattern = listTag === "ul" ? BULLET : NUMBERED;
      const list = element(listTag);
      while (i < lines.length && pattern.test(lines[i])) {
        const item = element("li");
        appendInline(item, lines[i++].match(pattern)[1]);
        list.append(item);
      }
      out.append(list);
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
    if (!line.trim()) {
      i += 1;
      continue;
    }
    // A paragraph: lines up to a blank line or the start of another block.
    const paragraph = element("p");
    const body = [];
    while (
      i < lines.length &&
      lines[i].trim() &&
      !FENCE.test(lines[i]) &&
      !HEADING.test(lines[i]) &&
      !BULLET.test(lines[i]) &&
      !NUMBERED.test(lines[i]) &&
      !QUOTE.test(lines[i])
    )
      body.push(lines[i++]);
    body.forEach((part, n) => {
      if (n) paragraph.append(element("br"));
      appendInline(paragraph, part);
    });
    out.append(paragraph);
  }
  return out;
}
