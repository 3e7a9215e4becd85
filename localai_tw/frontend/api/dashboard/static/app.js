// localai-tw dashboard: polls the admin API and the OpenAI API every 2 s with the API key the
// operator typed (kept in sessionStorage; in localStorage only when ticked on the chat or
// gallery page; the page itself holds no secret).  Every value
// from the server goes into the page as text (textContent), never as HTML.
"use strict";

const POLL_MS = 2000;
const KEY = "localai-tw-api-key";

// The chat and gallery pages may keep it in localStorage instead ("remember", key.js).
function apiKey() { return sessionStorage.getItem(KEY) || localStorage.getItem(KEY) || ""; }

function headers(extra) {
  const h = Object.assign({}, extra || {});
  const key = apiKey();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function getJSON(path) {
  const r = await fetch(path, {headers: headers(), cache: "no-store"});
  let body = null;
  try { body = await r.json(); } catch (e) { body = null; }
  if (!r.ok) {
    const msg = body && body.error ? body.error.message : r.status + " " + r.statusText;
    const err = new Error(msg);
    err.status = r.status;
    throw err;
  }
  return body;
}

// Every node: /api/nodes answers a page at a time (1000 by name), "next" names where the
// following page starts.
async function getAllNodes() {
  let nodes = [], after = null;
  do {
    const page = await getJSON("/api/nodes" + (after ? "?after=" + encodeURIComponent(after) : ""));
    nodes = nodes.concat(page.nodes);
    after = page.next;
  } while (after);
  return {nodes: nodes};
}

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

function badge(text, cls) { return el("span", {class: "badge " + cls}, text); }

function age(iso) {
  if (!iso) return "never";
  const s = Math.max(0, Math.round((Date.now() - Date.parse(iso)) / 1000));
  if (s < 120) return s + " s ago";
  if (s < 7200) return Math.round(s / 60) + " min ago";
  return Math.round(s / 3600) + " h ago";
}

function bytes(n) {
  if (n === null || n === undefined || n === 0) return null;
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return n.toFixed(i ? 1 : 0) + " " + units[i];
}

// Presence by condition: never "failed" (docs/operators.md, "What the error conditions mean").
function presence(node) {
  switch (node.presence) {
    case "connected": return badge("connected", "connected");
    case "reconnecting":
      return badge(node.reconnect_grace_left === null || node.reconnect_grace_left === undefined
                   ? "reconnecting (away, within the grace)"
                   : "reconnecting (" + Math.round(node.reconnect_grace_left)
                     + " s of the grace left)", "reconnecting");
    case "gone": return badge("gone (away longer than the grace)", "gone");
    default:
      if (node.presence_error) return badge("unknown (" + node.presence_error + ")", "unknown");
      if (node.never_connected) return badge("never connected", "never-connected");
      return badge("unknown", "unknown");
  }
}

function capacity(c) {
  const parts = [];
  for (const [label, total, avail] of [["RAM", c.total_ram, c.available_ram],
                                       ["disk", c.total_disk, c.available_disk],
                                       ["GPU", c.total_vram, c.available_vram]]) {
    const t = bytes(total);
    if (!t) continue;
    const used = total - (avail || 0);
    parts.push(label + " " + (bytes(used) || "0 B") + " used of " + t);
  }
  return parts.length ? parts.join("; ") : "not reported";
}

async function nodeAction(node, verb) {
  const status = document.getElementById("status");
  try {
    const r = await fetch("/api/nodes/" + encodeURIComponent(node.id) + "/" + verb,
                          {method: "POST", headers: headers()});
    if (!r.ok) {
      let msg = r.status + "";
      try { msg = (await r.json()).error.message; } catch (e) { /* keep the status */ }
      status.textContent = verb + " " + node.name + ": " + msg;
      status.className = "error";
    }
  } finally {
    poll();
  }
}

function actions(node) {
  const td = el("td");
  if (node.status === "pending")
    td.append(el("button", {class: "approve", "data-node": node.name,
                            onclick: () => nodeAction(node, "approve")}, "Approve"));
  else if (node.status === "draining")
    td.append(el("button", {class: "resume", "data-node": node.name,
                            onclick: () => nodeAction(node, "resume")}, "Resume"));
  else if (node.approved)
    td.append(el("button", {class: "drain", "data-node": node.name,
                            onclick: () => nodeAction(node, "drain")}, "Drain"));
  return td;
}

function renderNodes(nodes) {
  const body = document.getElementById("nodes-body");
  body.replaceChildren(...nodes.map(n => el("tr", {"data-node": n.name},
    el("td", {}, n.name, el("div", {class: "small"}, n.node_type + " · " + n.id)),
    el("td", {}, Object.entries(n.labels).map(([k, v]) => k + "=" + v).join(", ")),
    el("td", {class: "presence"}, presence(n)),
    el("td", {}, n.owner ? n.owner.replica + " (epoch " + n.owner.epoch + ")" : "none"),
    el("td", {class: "approval"}, badge(n.status, n.status),
      n.unapproved && n.status !== "pending"
        ? badge(n.new ? "new, unapproved" : "unapproved", "pending unapproved") : ""),
    el("td", {}, capacity(n.capacity)),
    el("td", {}, n.models.length ? n.models.map(m => m.model_name + " #" + m.replica_index
      + " " + m.state + " (" + m.in_flight + ")").join(", ") : "none"),
    el("td", {}, age(n.last_heartbeat)),
    actions(n))));
  if (!nodes.length) body.append(el("tr", {}, el("td", {colspan: 9}, "no workers registered")));
}

function renderReplicas(instances, nodes) {
  const body = document.getElementById("replicas-body");
  body.replaceChildren(...instances.map(i => el("tr", {"data-replica": i.id},
    el("td", {}, i.id + (i.self ? " (this one)" : "")),
    el("td", {}, i.advertised_addr || ""),
    el("td", {}, i.version || ""),
    el("td", {}, badge("live", "live"), " seen " + age(i.last_seen)),
    el("td", {}, nodes.filter(n => n.owner && n.owner.replica === i.id)
      .map(n => n.name).join(", ") || "none"))));
}

// Unload one model on one node (POST /api/nodes/{id}/models/{model}/unload): the row goes
// only when the worker answers that it stopped it; a refusal (busy, reconnecting) is shown.
async function unloadModel(node, model) {
  const status = document.getElementById("status");
  try {
    const r = await fetch("/api/nodes/" + encodeURIComponent(node.id) + "/models/"
                          + encodeURIComponent(model.model_name) + "/unload",
                          {method: "POST", headers: headers()});
    if (!r.ok) {
      let msg = r.status + "";
      try { msg = (await r.json()).error.message; } catch (e) { /* keep the status */ }
      status.textContent = "unload " + model.model_name + " on " + node.name + ": " + msg;
      status.className = "error";
    }
  } finally {
    poll();
  }
}

function renderModels(models, nodes) {
  const where = {};
  for (const n of nodes)
    for (const m of n.models) {
      const place = el("span", {class: "placement", "data-node": n.name},
                       n.name + " (" + m.state + ", " + m.in_flight + " in flight) ");
      if (m.state === "loaded")
        place.append(el("button", {class: "unload", "data-node": n.name,
                                   "data-model": m.model_name,
                                   onclick: () => unloadModel(n, m)}, "Unload"));
      // what the worker changed when it started the model (e.g. the AMX fallback of llama.cpp)
      if (m.note) place.append(el("div", {class: "small note"}, m.note));
      (where[m.model_name] = where[m.model_name] || []).push(place);
    }
  const body = document.getElementById("models-body");
  body.replaceChildren(...models.data.map(m => el("tr", {"data-model": m.id},
    el("td", {}, m.id), el("td", {class: "where"}, ...(where[m.id] || ["not loaded"])))));
  const errors = document.getElementById("model-errors");
  errors.replaceChildren(...(models.errors || []).map(e => el("p", {class: "error"},
    "config " + e.id + " did not load: " + e.error)));
  const select = document.getElementById("play-model");
  const chosen = select.value;
  const ids = models.data.map(m => m.id);
  if (ids.join("\n") !== Array.from(select.options).map(o => o.value).join("\n")) {
    select.replaceChildren(...ids.map(id => el("option", {value: id}, id)));
    if (ids.includes(chosen)) select.value = chosen;
  }
}

// The load lock's phases, in order: the bar shows how far a cold load has come.
const PHASES = ["choosing", "starting", "staging", "loading"];

function mib(n) { return (n / 1048576).toFixed(1) + " MiB"; }

// A model file this replica downloads before a cold load (download_files, a URL model).
function renderDownload(d) {
  const bar = d.total === null ? {} : {max: d.total, value: d.received};
  return el("div", {class: "load", "data-download": d.model + "/" + d.file},
    el("strong", {}, d.model),
    el("span", {}, "downloading " + d.file),
    el("progress", bar),
    el("span", {class: "phase"}, mib(d.received) + (d.total === null ? "" : " of " + mib(d.total))
       + " at " + mib(d.bytes_per_second) + "/s"),
    el("span", {class: "small"}, Math.round(d.seconds) + " s, by " + d.replica));
}

function renderLoads(loads, downloads, nodes) {
  const names = Object.fromEntries(nodes.map(n => [n.id, n.name]));
  const box = document.getElementById("loads");
  if (!loads.length && !downloads.length) {
    box.replaceChildren(el("p", {class: "small"}, "none"));
    return;
  }
  box.replaceChildren(...downloads.map(renderDownload), ...loads.map(l => {
    const step = PHASES.indexOf(l.phase) + 1;
    return el("div", {class: "load", "data-load": l.model},
      el("strong", {}, l.model),
      el("span", {}, "on " + (l.node_id ? (names[l.node_id] || l.node_id) : "(choosing a node)")),
      // Full only once loaded: the bar counts the phases already done.
      el("progress", {max: PHASES.length, value: step - 1}),
      el("span", {class: "phase"}, l.phase + " (phase " + step + " of " + PHASES.length + ")"),
      renderStaging(l.staging),
      el("span", {class: "small"}, Math.round(l.seconds) + " s, by " + l.replica));
  }));
}

// Bytes a cold load has staged to its node (known to the replica driving it): a second bar.
function renderStaging(staging) {
  if (!staging || !staging.total_bytes) return null;
  const mb = n => (n / 1048576).toFixed(1);
  return el("span", {class: "staging"},
    el("progress", {max: staging.total_bytes, value: staging.staged_bytes}),
    el("span", {class: "small"}, mb(staging.staged_bytes) + " of " + mb(staging.total_bytes)
       + " MiB staged at " + mb(staging.bytes_per_second) + " MiB/s"));
}

// A trace's time in each hop (/api/traces "hops"), compact: "queue 0.002 · backend 0.041";
// a cold load shows its phases in brackets; first token is within backend.
const HOP_NAMES = [["queue", "queue"], ["placement", "place"], ["cold_load", "cold load"],
                   ["tunnel", "tunnel"], ["backend", "backend"], ["first_token", "1st token"]];
function renderHops(hops) {
  const fmt = v => v < 0.001 ? "<1 ms" : v < 1 ? Math.round(v * 1000) + " ms" : v.toFixed(2) + " s";
  const parts = [];
  for (const [key, label] of HOP_NAMES) {
    if (hops[key] === undefined) continue;
    let text = label + " " + fmt(hops[key]);
    if (key === "cold_load") {
      const phases = ["starting", "staging", "loading"].filter(p => hops[p] !== undefined)
        .map(p => p + " " + fmt(hops[p]));
      if (phases.length) text += " (" + phases.join(", ") + ")";
    }
    parts.push(el("span", {class: "hop", "data-hop": key}, text));
  }
  return parts.length ? parts : [""];
}

// This replica's last requests (/api/traces): what was asked of whom and how it went.
function renderTraces(traces, nodes) {
  const names = Object.fromEntries(nodes.map(n => [n.id, n.name]));
  const body = document.getElementById("traces-body");
  body.replaceChildren(...traces.map(t => el("tr", {"data-trace": t.id},
    el("td", {}, new Date(t.time * 1000).toLocaleTimeString()),
    el("td", {}, t.endpoint), el("td", {}, t.model),
    el("td", {}, t.nodes.map(id => names[id] || id).join(", ")), el("td", {}, t.path),
    el("td", {}, t.status, t.condition ? " " : null,
       t.condition ? badge(t.condition, "error") : null),
    el("td", {}, t.seconds.toFixed(3) + " s"),
    el("td", {}, t.first_token_seconds === null ? "" : t.first_token_seconds.toFixed(3) + " s"),
    el("td", {}, t.prompt_tokens + " / " + t.completion_tokens),
    el("td", {class: "hops"}, ...renderHops(t.hops || {})))));
}

// The newest jobs of the cluster (/api/jobs, docs/jobs.md).
function renderJobs(jobs) {
  const body = document.getElementById("jobs-body");
  body.replaceChildren(...jobs.map(j => el("tr", {"data-job": j.id},
    el("td", {class: "small", title: j.id}, j.id.slice(0, 8)),
    el("td", {}, j.kind),
    el("td", {class: "state"}, badge(j.state, "job-" + j.state),
       j.cancel_requested && j.state !== "cancelled" ? " cancel requested" : null),
    el("td", {}, j.runs),
    el("td", {}, age(j.created_at)),
    el("td", {}, j.finished_at ? age(j.finished_at) : ""),
    el("td", {class: "error"}, j.error || ""))));
}

let polling = false;
async function poll() {
  if (polling) return;
  polling = true;
  const status = document.getElementById("status");
  try {
    let nodes = [];
    try {
      const [n, inst, loads, traces] = await Promise.all([
        getAllNodes(), getJSON("/api/cluster/instances"),
        getJSON("/api/cluster/loads"), getJSON("/api/traces?limit=50")]);
      nodes = n.nodes;
      renderNodes(nodes);
      renderReplicas(inst.instances, nodes);
      renderLoads(loads.loads, loads.downloads || [], nodes);
      renderTraces(traces.traces, nodes);
      status.textContent = "updated " + new Date().toLocaleTimeString();
      status.className = "";
    } catch (e) {
      status.textContent = e.status === 401 ? "enter the admin API key (" + e.message + ")"
                                            : "admin API: " + e.message;
      status.className = "error";
    }
    try {
      renderJobs((await getJSON("/api/jobs?limit=20")).jobs);
    } catch (e) {
      // The status line already says why the admin API did not answer.
    }
    try {
      renderModels(await getJSON("/v1/models"), nodes);
    } catch (e) {
      document.getElementById("model-errors").replaceChildren(
        el("p", {class: "error"}, "/v1/models: " + e.message));
    }
  } finally {
    polling = false;
  }
}

// Chat streams tokens as they come: the SSE body read through a ReadableStream.
async function chat(model, text, out, note) {
  const r = await fetch("/v1/chat/completions", {
    method: "POST", headers: headers({"Content-Type": "application/json"}),
    body: JSON.stringify({model: model, stream: true,
                          messages: [{role: "user", content: text}]})});
  if (!r.ok) {
    let msg = r.status + "";
    try { msg = (await r.json()).error.message; } catch (e) { /* keep the status */ }
    throw new Error(msg);
  }
  const reader = r.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, {stream: true});
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") { note.textContent = "done"; return; }
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        for (const choice of chunk.choices || []) {
          if (choice.delta && choice.delta.content) out.textContent += choice.delta.content;
          if (choice.finish_reason) note.textContent = "finished: " + choice.finish_reason;
        }
      }
    }
  }
}

async function embed(model, text, out, note) {
  const r = await fetch("/v1/embeddings", {
    method: "POST", headers: headers({"Content-Type": "application/json"}),
    body: JSON.stringify({model: model, input: text})});
  const body = await r.json();
  if (!r.ok) throw new Error(body.error ? body.error.message : r.status + "");
  const v = body.data[0].embedding;
  out.textContent = v.length + " dimensions: [" + v.slice(0, 8).map(x => x.toFixed(4))
    .join(", ") + (v.length > 8 ? ", ..." : "") + "]";
  note.textContent = "done";
}

async function play(ev) {
  ev.preventDefault();
  const model = document.getElementById("play-model").value;
  const text = document.getElementById("play-input").value;
  const kind = document.querySelector("input[name=play-kind]:checked").value;
  const out = document.getElementById("play-output");
  const note = document.getElementById("play-status");
  out.textContent = "";
  note.textContent = "waiting for " + model + " (a cold load can take a while)";
  note.className = "";
  try {
    await (kind === "chat" ? chat : embed)(model, text, out, note);
  } catch (e) {
    note.textContent = e.message;
    note.className = "error";
  }
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("key-form").addEventListener("submit", ev => {
    ev.preventDefault();
    const input = document.getElementById("api-key");
    sessionStorage.setItem(KEY, input.value);
    input.value = "";
    poll();
  });
  document.getElementById("key-forget").addEventListener("click", () => {
    sessionStorage.removeItem(KEY);
    localStorage.removeItem(KEY);
    poll();
  });
  document.getElementById("play-form").addEventListener("submit", play);
  poll();
  setInterval(poll, POLL_MS);
});
