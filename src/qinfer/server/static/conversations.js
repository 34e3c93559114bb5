// The local history of conversations: every chat of this page, kept in the browser's
// localStorage under "qinfer.chats" as {current: id, chats: [chat]}, where a chat is
// {id, title, named, updated, messages} (messages: see chat.js). A chat is titled by its
// first message until the user names it; "New chat" starts another and keeps the old one.

const STORAGE = "qinfer.chats";
const TITLE_LENGTH = 48;

function newChat() {
  const id = `${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 8)}`;
  return { id, title: "", named: false, updated: Date.now(), messages: [] };
}

function read() {
  try {
    const stored = JSON.parse(localStorage.getItem(STORAGE));
    if (stored && Array.isArray(stored.chats)) return stored;
  } catch {
    // unreadable: start again
  }
  const chat = newChat();
  return { current: chat.id, chats: [chat] };
}

export class Conversations {
  constructor() {
    this.state = read();
    if (!this.state.chats.some((chat) => chat.id === this.state.current)) this.start();
  }

  // The chat on the page.
  get current() {
    return this.state.chats.find((chat) => chat.id === this.state.current);
  }

  // The chats to list, newest first: the current one, and the others that have messages.
  listed() {
    return this.state.chats
      .filter((chat) => chat.messages.length || chat.id === this.state.current)
      .sort((a, b) => b.updated - a.updated);
  }

  title(chat) {
    if (chat.named) return chat.title;
    const first = chat.messages.find((message) => message.role === "user");
    if (!first) return "New chat";
    const line = first.content.trim().split("\n")[0] || "Image"; // an image sent alone
    return line.length > TITLE_LENGTH ? `${line.slice(0, TITLE_LENGTH - 1)}…` : line;
  }

  // Store the history; touched: the current chat changed (it moves to the top).
  save(touched = true) {
    if (touched) this.current.updated = Date.now();
    // Chats left empty are dropped, but for the current one.
    this.state.chats = this.state.chats.filter(
      (chat) => chat.messages.length || chat.id === this.state.current,
    );
    for (;;) {
      try {
        localStorage.setItem(STORAGE, JSON.stringify(this.state));
        return;
      } catch (error) {
        // The browser's quota is full: the oldest other chat goes, then try again.
        const others = this.state.chats.filter((chat) => chat.id !== this.state.current);
        if (!others.length) throw error;
        const oldest = others.reduce((a, b) => (a.updated < b.updated ? a : b));
        this.remove(oldest.id, false);
      }
    }
  }

  // Make a new, empty chat the current one (the current one, if it is still empty).
  start() {
    if (!this.current || this.current.messages.length) {
      const chat = newChat();
      this.state.chats.push(chat);
      this.state.current = chat.id;
    }
    this.save();
  }

  switchTo(id) {
    if (!this.state.chats.some((chat) => chat.id === id)) return;
    this.state.current = id;
    this.save(false);
  }

  rename(id, title) {
    const chat = this.state.chats.find((c) => c.id === id);
    if (!chat) return;
    chat.title = title.trim();
    chat.named = Boolean(chat.title);
    this.save(false);
  }

  // Delete a chat; deleting the current one moves to the newest other (or a new one).
  remove(id, store = true) {
    this.state.chats = this.state.chats.filter((chat) => chat.id !== id);
    if (this.state.current === id) {
      const newest = this.listed()[0];
      if (newest) this.state.current = newest.id;
      else {
        const chat = newChat();
        this.state.chats.push(chat);
        this.state.current = chat.id;
      }
    }
    if (store) this.save(false);
  }
}
