// The gallery page: LocalAI's gallery routes (/models/available, /models/galleries,
// /models/apply, /models/jobs/{uuid}), which need the admin key.  The search filters the
// listed entries in the page; an install's job is polled until it is done or failed.
"use strict";

const POLL_JOB_MS = 500;
const galleryState = {entries: [], jobs: {}};  // jobs: entry id -> last job status

function $(id) { return document.getElementById(id); }

function note(text, isError) {
  const status = $("gallery-status");
  status.textContent = text;
  status.className = isError ? "small error" : "small";
}

async function getJSON(path) {
  const r = await fetch(path, {headers: authHeaders(), cache: "no-store"});
  if (!r.ok) {
    const error = new Error(await errorText(r));
    error.status = r.status;
    throw error;
  }
  return r.json();
}

async function loadGallery() {
  try {
    const [galleries, entries] = await Promise.all([
      getJSON("/models/galleries"), getJSON("/models/available")]);
    $("galleries").textContent = galleries.length
      ? "galleries: " + galleries.map(g => g.name).join(", ") : "no gallery is configured";
    galleryState.entries = entries;
    note(entries.length + " entries");
  } catch (e) {
    galleryState.entries = [];
    note(e.status === 401 || e.status === 403
      ? "enter the admin API key (" + e.message + ")" : e.message, true);
  }
  render();
}

function matches(entry, words) {
  const text = [entry.name, entry.description, (entry.tags || []).join(" "),
                entry.gallery && entry.gallery.name].join(" ").toLowerCase();
  return words.every(w => text.includes(w));
}

function entryId(entry) {
  return (entry.gallery && entry.gallery.name ? entry.gallery.name + "@" : "") + entry.name;
}

function jobCell(entry) {
  const job = galleryState.jobs[entryId(entry)];
  if (!job) return entry.installed ? el("span", {class: "badge healthy"}, "installed") : "";
  const cell = el("div", {class: "job", "data-state": job.state});
  cell.append(el("span", {class: "badge job-" + (job.state === "done" ? "succeeded"
    : job.state === "failed" ? "failed" : "running")}, job.state));
  if (job.state !== "done" && job.state !== "failed") {
    const bar = el("progress", {max: 100});
    bar.value = Math.max(0, Math.min(100, job.progress || 0));
    cell.append(" ", bar);
  }
  const detail = job.error ? job.error
    : job.file_name ? job.file_name + " " + (job.downloaded_size || "") + " of "
      + (job.file_size || "?") : job.message || "";
  if (detail) cell.append(" ", el("span", {class: job.error ? "error" : "small"}, detail));
  return cell;
}

function render() {
  const words = $("gallery-search").value.toLowerCase().split(/\s+/).filter(Boolean);
  const rows = galleryState.entries.filter(e => matches(e, words)).map(entry => {
    const id = entryId(entry);
    const job = galleryState.jobs[id];
    const busy = job && job.state !== "done" && job.state !== "failed";
    const button = el("button", {class: "install", "data-id": id, type: "button",
                                 disabled: busy}, entry.installed ? "Reinstall" : "Install");
    button.addEventListener("click", () => install(entry));
    return el("tr", {"data-entry": entry.name},
      el("td", {class: "name"}, entry.name),
      el("td", {class: "description"}, (entry.description || "").slice(0, 300)),
      el("td", {class: "tags"}, (entry.tags || []).join(", ")),
      el("td", {}, entry.gallery ? entry.gallery.name : ""),
      el("td", {class: "state"}, jobCell(entry)),
      el("td", {}, button));
  });
  $("gallery-body").replaceChildren(...rows);
}

async function install(entry) {
  const id = entryId(entry);
  galleryState.jobs[id] = {state: "queued", progress: 0, message: "asking"};
  render();
  try {
    const r = await fetch("/models/apply", {
      method: "POST", headers: authHeaders({"Content-Type": "application/json"}),
      body: JSON.stringify(entry.installed ? {id: id, replace: true} : {id: id})});
    if (!r.ok) throw new Error(await errorText(r));
    const accepted = await r.json();
    await follow(id, accepted.uuid);
  } catch (e) {
    galleryState.jobs[id] = {state: "failed", error: e.message};
    render();
  }
}

// Polls the job until it is done or failed, then reads the list again (installed flags).
async function follow(id, uuid) {
  for (;;) {
    let job;
    try {
      job = await getJSON("/models/jobs/" + encodeURIComponent(uuid));
    } catch (e) {
      if (e.status !== 404) throw e;  // not broadcast to this replica yet: ask again
      job = {state: "queued", progress: 0, message: "queued"};
    }
    galleryState.jobs[id] = job;
    render();
    if (job.state === "done" || job.state === "failed") break;
    await new Promise(resolve => setTimeout(resolve, POLL_JOB_MS));
  }
  await loadGallery();
}

document.addEventListener("DOMContentLoaded", () => {
  wireKeyForm(loadGallery);
  $("gallery-search").addEventListener("input", render);
  loadGallery();
});
