// Syntax colours for code blocks. highlight.js marks the code up (vendored as
// highlight.min.js: v11.12.0, the common-languages ES module build from npm's
// @highlightjs/cdn-assets, BSD-3-Clause, see highlight-LICENSE.txt); its markup is read in
// an inert document and only its <span class="..."> nodes and text are rebuilt as DOM, so
// what the model writes in a code block stays text, as everywhere else on the page.

import hljs from "./highlight.min.js";

const CLASS_NAME = /^[\w-]+$/; // highlight.js's scopes: "hljs-keyword", "function_", ...

// Copy `from`'s text and spans into `to`; any other element keeps only its text.
function copySpans(from, to) {
  for (const child of from.childNodes) {
    if (child.nodeType === Node.ELEMENT_NODE && child.tagName === "SPAN") {
      const span = document.createElement("span");
      span.className = [...child.classList].filter((name) => CLASS_NAME.test(name)).join(" ");
      copySpans(child, span);
      to.append(span);
    } else {
      to.append(child.textContent);
    }
  }
}

// A <code> element showing `code`, coloured when highlight.js knows `language` (a fence's
// info string such as "python"); plain text otherwise (guessing costs too much per frame).
export function codeElement(language, code) {
  const node = document.createElement("code");
  if (!language || !hljs.getLanguage(language)) {
    node.textContent = code;
    return node;
  }
  const marked = hljs.highlight(code, { language, ignoreIllegals: true }).value;
  // DOMParser's documents run no scripts and load nothing: the markup is only read. After
  // <body> the parser keeps leading whitespace (before it, blank lines would be dropped).
  const parsed = new DOMParser().parseFromString(`<body>${marked}`, "text/html").body;
  node.className = "hljs";
  copySpans(parsed, node);
  return node;
}
