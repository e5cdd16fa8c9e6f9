// Flotilla's dashboard: polls the node's /api endpoints and redraws. No framework, no
// network access beyond this node.
"use strict";

const POLL_MS = 1000;
const $ = (id) => document.getElementById(id);
const esc = (v) => String(v ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
const key = (p) => `${p.stream}/${p.partition ?? "queue"}`;

// The node's token (--http-token): taken from the URL fragment, `/#token=…`, which the
// browser never sends to the server, then kept for this tab only and dropped from the
// address bar. Every request sends it as `Authorization: Bearer …`.
const TOKEN_KEY = "flotilla-token";
function takeToken() {
  const m = /(?:^#|&)token=([^&]*)/.exec(location.hash);
  if (m) {
    sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname + location.search);
  }
}
takeToken();
window.addEventListener("hashchange", () => { takeToken(); servedBy(); });
const token = () => sessionStorage.getItem(TOKEN_KEY);
const auth = () => (token() ? { Authorization: `Bearer ${token()}` } : {});
const TOKEN_HINT = `open this page as ${location.origin}/#token=TOKEN, with the node's --http-token`;

let previous = null;        // the last status, for rates and moves
let previousAt = 0;
const localEvents = [];     // lease moves and membership changes seen between polls
const movedAt = new Map();  // partition key -> when it last changed owner

function duration(ms) {
  if (ms == null) return "–";
  const s = Math.floor(ms / 1000);
  if (s < 1) return `${ms} ms`;
  if (s < 60) return `${s} s`;
  if (s < 3600) return `${Math.floor(s / 60)} m ${s % 60} s`;
  return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} m`;
}
const clock = (ms) => new Date(ms).toLocaleTimeString();
const num = (n) => (n == null ? "–" : Number(n).toLocaleString());

function note(kind, text, level) {
  localEvents.push({ at_ms: Date.now(), type: kind, text, level });
  if (localEvents.length > 200) localEvents.shift();
}

function diff(status, now) {
  if (!previous) return {};
  const rates = {};
  const dt = (now - previousAt) / 1000;
  const before = new Map(previous.partitions.map((p) => [key(p), p]));
  for (const p of status.partitions) {
    const k = key(p);
    const old = before.get(k);
    if (!old) continue;
    // The moves themselves come as events (partition_acquired, _lost, _released).
    if (old.owner !== p.owner) movedAt.set(k, now);
    const delta = p.deliveries - old.deliveries;
    rates[k] = old.owner === p.owner && delta >= 0 && dt > 0 ? delta / dt : null;
  }
  const was = new Set(previous.members);
  for (const m of status.members) if (!was.has(m)) note("node_joined", `node ${m} joined`, "info");
  for (const m of was) if (!status.members.includes(m)) note("node_left", `node ${m} left`, "warn");
  return rates;
}

function renderStatus(s, rates) {
  $("job").textContent = s.job;
  const owned = s.partitions.filter((p) => p.owner).length;
  const backlog = s.partitions.reduce((a, p) => a + p.backlog, 0);
  const age = s.partitions.reduce((a, p) => Math.max(a, p.backlog > 0 ? p.oldest_ms : 0), 0);
  const rate = Object.values(rates).reduce((a, r) => a + (r ?? 0), 0);
  $("c-nodes").textContent = `${s.nodes.length}${s.silent.length ? ` (+${s.silent.length} silent)` : ""}`;
  $("c-owned").textContent = `${owned} / ${s.partitions.length}`;
  $("c-backlog").textContent = num(backlog);
  $("c-age").textContent = backlog ? duration(age) : "–";
  $("c-rate").textContent = previous ? rate.toFixed(1) : "–";
  $("c-dlq").textContent = num(s.dlq);

  const counts = new Map();
  for (const p of s.partitions) if (p.owner) counts.set(p.owner, (counts.get(p.owner) ?? 0) + 1);
  const now = Date.now();
  const nodeRows = s.nodes.map((n) => {
    const inFlight = n.slots.reduce((a, x) => a + x.in_flight, 0);
    const state = n.leaving ? "leaving" : "running";
    return `<tr data-node="${esc(n.node)}"><td>${esc(n.node)}</td><td>${esc(n.host)}</td><td>${esc(n.version)}</td>` +
      `<td>${n.started_ms ? duration(now - n.started_ms) : "–"}</td><td class="num">${num(inFlight)}</td>` +
      `<td class="num">${num(counts.get(n.node) ?? 0)}</td><td class="state-${state}">${state}</td></tr>`;
  });
  for (const m of s.silent) {
    nodeRows.push(`<tr data-node="${esc(m)}"><td>${esc(m)}</td><td colspan="5" class="hint">did not answer (dead or stuck: its leases run out)</td><td class="state-silent">silent</td></tr>`);
  }
  $("nodes").tBodies[0].innerHTML = nodeRows.join("");

  $("partitions").tBodies[0].innerHTML = s.partitions.map((p) => {
    const k = key(p);
    const queue = p.partition == null;
    const state = p.paused ? "paused" : p.drained ? "drained" : p.owner || queue ? "running" : "unowned";
    const moved = movedAt.has(k) && now - movedAt.get(k) < 2500 ? ' class="moved"' : "";
    const r = rates[k];
    return `<tr data-key="${esc(k)}"${moved}><td>${esc(p.stream)}</td><td class="num">${p.partition ?? "queue"}</td>` +
      `<td class="owner">${esc(p.owner ?? (queue ? "(every node)" : "–"))}</td><td class="num">${p.epoch ?? "–"}</td><td class="num">${num(p.backlog)}</td>` +
      `<td class="num">${p.backlog ? duration(p.oldest_ms) : "–"}</td><td class="num">${r == null ? "–" : r.toFixed(1)}</td>` +
      `<td class="num">${num(p.in_flight)}</td><td class="state-${state}">${state}</td></tr>`;
  }).join("");

  const boxes = [];
  if (s.pending_drain) {
    const d = s.pending_drain;
    const pct = d.partitions ? Math.round((100 * d.drained) / d.partitions) : 0;
    boxes.push(`<div class="box" id="drain">Drain of run ${esc(d.run_id)} requested ${duration(now - d.issued_ms)} ago: ` +
      `${d.drained} of ${d.partitions} partitions drained<div class="bar"><div style="width:${pct}%"></div></div></div>`);
  }
  const leaving = s.nodes.filter((n) => n.leaving);
  if (leaving.length) {
    const left = leaving.map((n) => `${esc(n.node)} (${n.slots.filter((x) => x.state !== "finished").length} partitions still running)`);
    boxes.push(`<div class="box" id="shutdown">Stopping: ${left.join(", ")}</div>`);
  }
  const paused = s.partitions.filter((p) => p.paused).length;
  if (paused) boxes.push(`<div class="box">${paused} partitions paused</div>`);
  if (s.parked_messages) boxes.push(`<div class="box">${num(s.parked_messages)} messages parked for keys ${esc(JSON.stringify(s.parked_keys))}</div>`);
  $("progress").innerHTML = boxes.join("");
}

function describe(e) {
  switch (e.type) {
    case "dead_lettered": return `${e.stream}${e.partition != null ? "/" + e.partition : ""} seq ${e.seq}: ${e.reason} – ${e.detail}`;
    case "degraded": return `backlog ${num(e.total_backlog)} (most on ${e.stream}${e.partition != null ? "/" + e.partition : ""}, oldest ${duration(e.oldest_age_ms)})`;
    case "recovered": return `backlog back to ${num(e.total_backlog)}`;
    case "queue_unavailable": return `${e.stream}: ${e.error} (retry in ${duration(e.retry_in_ms)})`;
    case "queue_available": return `${e.stream} reachable again`;
    case "task_failed": return `${e.stream}${e.partition != null ? "/" + e.partition : ""}: ${e.reason}`;
    case "state_restored": return `${e.stream}/${e.partition}: ${num(e.keys)} keys in ${e.millis} ms`;
    case "state_restore_failed": return `${e.stream}/${e.partition}: ${e.error}`;
    case "partition_acquired": return `${e.stream}/${e.partition} taken by ${e.node} (epoch ${e.epoch}, ${e.how})`;
    case "partition_lost": return `${e.stream}/${e.partition} lost by ${e.node}: ${e.why}`;
    case "partition_released": return `${e.stream}/${e.partition} handed over by ${e.node}`;
    case "parked_after_unpark": return e.error ? `${e.stream} key ${e.key}: parked after its unpark, not sent back (${e.error}): unpark it again` : `${e.stream} key ${e.key}: ${num(e.sent_back)} parked after its unpark, sent back`;
    case "done_not_recorded": return `${e.stream}/${e.partition} ${e.done} on ${e.node}, not recorded (${e.failures} tries: ${e.error}); lease kept, retry in ${duration(e.retry_in_ms)}`;
    default: return e.text ?? JSON.stringify(e);
  }
}
const LEVELS = ["info", "warn", "bad"];
const level = (e) => (LEVELS.includes(e.level) ? e.level : null) ?? ({ dead_lettered: "bad", task_failed: "bad", degraded: "warn", queue_unavailable: "warn", state_restore_failed: "bad", partition_lost: "bad", partition_released: "warn", done_not_recorded: "warn" }[e.type] ?? "info");

function renderEvents(server) {
  const all = server.concat(localEvents).sort((a, b) => (b.at_ms ?? 0) - (a.at_ms ?? 0)).slice(0, 100);
  $("events").innerHTML = all.map((e) =>
    `<li class="${esc(level(e))}" data-type="${esc(e.type)}"><span class="t">${e.at_ms ? clock(e.at_ms) : ""}</span><span class="k">${esc(e.type)}</span> ${esc(describe(e))}</li>`
  ).join("") || '<li class="hint">nothing yet</li>';
}

function renderDlq(entries, total) {
  const disabled = token() ? "" : ` disabled title="replay needs the node's token: ${esc(TOKEN_HINT)}"`;
  $("dlq").tBodies[0].innerHTML = entries.map((d) =>
    `<tr data-id="${d.id}"><td class="num">${d.id}</td><td>${esc(d.stream)}</td><td>${esc(d.key ?? "")}</td><td>${esc(d.reason)}</td>` +
    `<td class="num">${d.attempts}</td><td>${clock(d.dead_lettered_ms)}</td><td class="detail">${esc(d.detail)}</td>` +
    `<td><button class="replay" data-id="${d.id}"${disabled}>Replay</button></td></tr>`
  ).join("");
  const notes = [];
  if (!entries.length) notes.push("The dead-letter stream is empty.");
  if (entries.length && total > entries.length) notes.push(`The oldest ${entries.length} of ${num(total)} are shown (\`flotilla dlq list\` lists more).`);
  if (entries.length && !token()) notes.push(`Replaying needs the node's token: ${TOKEN_HINT}.`);
  $("dlq-note").textContent = notes.join(" ");
}

async function getJson(path) {
  const r = await fetch(path, { cache: "no-store", headers: auth() });
  const body = await r.json();
  if (r.status === 401) throw Object.assign(new Error(`this node needs its token: ${TOKEN_HINT}`), { token: true });
  if (!r.ok) throw new Error(body.error ?? r.statusText);
  return body;
}

async function poll() {
  try {
    // Status first: the events read after it are at least as new (a move it shows is
    // listed with it).
    const status = await getJson("/api/status");
    const [events, dlq] = await Promise.all([getJson("/api/events"), getJson("/api/dlq?limit=50").catch(() => null)]);
    const now = Date.now();
    const rates = diff(status, now);
    renderStatus(status, rates);
    renderEvents(events);
    if (dlq) renderDlq(dlq, status.dlq);
    previous = status;
    previousAt = now;
    $("conn").textContent = "live";
    $("conn").className = "pill ok";
    $("updated").textContent = clock(now);
  } catch (e) {
    $("conn").textContent = e.token ? e.message : `unreachable: ${e.message}`;
    $("conn").className = "pill bad";
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

document.addEventListener("click", async (ev) => {
  const button = ev.target.closest("button.replay");
  if (!button) return;
  button.disabled = true;
  button.textContent = "Replaying…";
  try {
    const r = await fetch(`/api/dlq/${encodeURIComponent(button.dataset.id)}/replay`, { method: "POST", headers: auth() });
    const body = await r.json();
    if (!r.ok) throw new Error(body.error ?? r.statusText);
    note("replayed", `dead letter ${button.dataset.id} replayed`, "info");
    button.closest("tr").remove();
  } catch (e) {
    button.disabled = false;
    button.textContent = "Replay";
    alert(`Replay failed: ${e.message}`);
  }
});

function servedBy() {
  getJson("/api/node").then((n) => { $("served-by").textContent = `${n.node} (v${n.version})`; }).catch(() => {});
}
servedBy();
poll();
