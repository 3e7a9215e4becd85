// The chat page: a conversation with a model of /v1/models, streamed from
// /v1/chat/completions (the SSE body read through fetch's ReadableStream), stopped with an
// AbortController.  The conversation lives in this page's memory only; the key is key.js's.
"use strict";

const chatState = {
  messages: [],        // {role, content} sent back with every turn (the history)
  controller: null,    // the AbortController of the answer being streamed, if any
};

function $(id) { return document.getElementById(id); }

function setStatus(text, isError) {
  const status = $("chat-status");
  status.textContent = text;
  status.className = isError ? "error" : "";
}

async function loadModels() {
  const note = $("chat-models-status");
  const select = $("chat-model");
  try {
    const r = await fetch("/v1/models", {headers: authHeaders(), cache: "no-store"});
    if (!r.ok) {
      note.textContent = r.status === 401 ? "enter an API key to list the models ("
        + (await errorText(r)) + ")" : await errorText(r);
      note.className = "small error";
      select.replaceChildren();
      return;
    }
    const body = await r.json();
    const chosen = select.value;
    select.replaceChildren(...body.data.map(m => el("option", {value: m.id}, m.id)));
    if (chosen && body.data.some(m => m.id === chosen)) select.value = chosen;
    note.textContent = body.data.length ? body.data.length + " models" : "no model configured";
    note.className = "small";
  } catch (e) {
    note.textContent = "/v1/models: " + e.message;
    note.className = "small error";
  }
}

// One message of the log; returns the element its text goes into.
function addMessage(role, content) {
  const text = el("div", {class: "text"}, content);
  const item = el("div", {class: "msg " + role, "data-role": role},
                  el("div", {class: "who"}, role), text);
  $("chat-log").append(item);
  item.scrollIntoView({block: "end"});
  return text;
}

// Reads an SSE body and calls onData(json) for each "data:" event until [DONE], and
// onComment(text) for each comment (the replica's ": loading model ..." during a cold load).
async function readEvents(body, onData, onComment) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return false;
    buffer += decoder.decode(value, {stream: true}).replace(/\r\n?/g, "\n");
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (line.startsWith(":") && line.slice(1).trim()) onComment(line.slice(1).trim());
      }
      const data = event.split("\n").filter(l => l.startsWith("data:"))
        .map(l => l.slice(5).replace(/^ /, "")).join("\n");
      if (!data) continue;  // only comments, or an empty event
      if (data.trim() === "[DONE]") return true;
      onData(JSON.parse(data));
    }
  }
}

async function send(ev) {
  if (ev) ev.preventDefault();
  if (chatState.controller) return;  // one answer at a time
  const input = $("chat-input");
  const text = input.value;
  const model = $("chat-model").value;
  if (!text.trim()) return;
  if (!model) { setStatus("choose a model first", true); return; }
  input.value = "";
  chatState.messages.push({role: "user", content: text});
  addMessage("user", text);
  const out = addMessage("assistant", "");
  const system = $("chat-system").value;
  const messages = (system.trim() ? [{role: "system", content: system}] : [])
    .concat(chatState.messages);
  const controller = new AbortController();
  chatState.controller = controller;
  $("chat-send").disabled = true;
  $("chat-stop").disabled = false;
  setStatus("waiting for " + model + " (a model that is not loaded yet takes a while)");
  let answer = "";
  let finish = "";
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", signal: controller.signal,
      headers: authHeaders({"Content-Type": "application/json"}),
      body: JSON.stringify({model: model, stream: true, messages: messages})});
    if (!r.ok) throw new Error(await errorText(r));
    setStatus("waiting for the first words");
    const ended = await readEvents(r.body, chunk => {
      if (chunk.error) throw new Error(chunk.error.message || "the stream failed");
      for (const choice of chunk.choices || []) {
        const piece = choice.delta && choice.delta.content;
        if (piece) { answer += piece; out.textContent = answer; }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      if (answer) setStatus("streaming");
    }, comment => { if (!answer) setStatus(comment); });
    if (!ended) throw new Error("the answer ended before [DONE]");
    setStatus("finished: " + (finish || "stop"));
  } catch (e) {
    if (e.name === "AbortError") {
      setStatus("stopped");
      out.parentElement.classList.add("stopped");
    } else {
      setStatus(e.message, true);
      out.parentElement.classList.add("failed");
    }
  } finally {
    controller.abort();  // a failed stream: its connection goes too (a no-op once it ended)
    // What arrived stays in the history (a stopped answer too), as the page shows it.
    if (answer) chatState.messages.push({role: "assistant", content: answer});
    else out.parentElement.remove();
    chatState.controller = null;
    $("chat-send").disabled = false;
    $("chat-stop").disabled = true;
  }
}

function stop() {
  if (chatState.controller) chatState.controller.abort();
}

function newConversation() {
  stop();
  chatState.messages = [];
  $("chat-log").replaceChildren();
  setStatus("");
}

document.addEventListener("DOMContentLoaded", () => {
  wireKeyForm(loadModels);
  $("chat-form").addEventListener("submit", send);
  $("chat-stop").addEventListener("click", stop);
  $("chat-new").addEventListener("click", newConversation);
  $("chat-input").addEventListener("keydown", ev => {
    if (ev.key === "Enter" && !ev.shiftKey) send(ev);
  });
  loadModels();
});
