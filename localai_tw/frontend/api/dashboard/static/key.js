// The API key of the chat and gallery pages (the dashboard's app.js keeps the same name).
// Nothing is stored until the user enters a key: then it is kept in sessionStorage (this tab,
// until it closes), or in localStorage when "remember" is ticked.  The page sends it only to
// its own origin, as "Authorization: Bearer".  "Forget" removes it from both.
"use strict";

const KEY_NAME = "localai-tw-api-key";

function apiKey() {
  return sessionStorage.getItem(KEY_NAME) || localStorage.getItem(KEY_NAME) || "";
}

function authHeaders(extra) {
  const h = Object.assign({}, extra || {});
  const key = apiKey();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

// Wires the page's #key-form (#api-key, #key-remember, #key-save, #key-forget, #key-state)
// and calls changed() after every change.
function wireKeyForm(changed) {
  const state = document.getElementById("key-state");
  const show = () => {
    state.textContent = localStorage.getItem(KEY_NAME) ? "key remembered on this device"
      : sessionStorage.getItem(KEY_NAME) ? "key kept for this tab" : "no key stored";
  };
  document.getElementById("key-form").addEventListener("submit", ev => {
    ev.preventDefault();
    const input = document.getElementById("api-key");
    const remember = document.getElementById("key-remember").checked;
    sessionStorage.removeItem(KEY_NAME);
    localStorage.removeItem(KEY_NAME);
    if (input.value) (remember ? localStorage : sessionStorage).setItem(KEY_NAME, input.value);
    input.value = "";
    show();
    changed();
  });
  document.getElementById("key-forget").addEventListener("click", () => {
    sessionStorage.removeItem(KEY_NAME);
    localStorage.removeItem(KEY_NAME);
    show();
    changed();
  });
  show();
}

// The message of an error answer ({"error": {"message"}}), else the status.
async function errorText(r) {
  try {
    const body = await r.json();
    if (body && body.error && body.error.message) return r.status + ": " + body.error.message;
  } catch (e) { /* not JSON: the status says enough */ }
  return r.status + " " + r.statusText;
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    node.setAttribute(name, value === true ? "" : value);
  }
  for (const child of children) {
    if (child === undefined || child === null) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}
