// Building the pages' DOM: every text goes in as textContent, never as HTML, so what the
// model or a user writes stays text.

// A new <tag> with a class and text (either may be left out).
export function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

// How a token shows on the page: whitespace made visible, so "\n" and " " are not blank.
export function tokenLabel(text) {
  return text.replace(/\n/g, "↵").replace(/\t/g, "⇥").replace(/ /g, "·") || "∅";
}
