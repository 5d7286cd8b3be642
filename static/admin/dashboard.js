// The admin dashboard: reads GET /api/stats/stream (server-sent events, one JSON snapshot per interval) with
// fetch() and a streaming body reader, since EventSource cannot send the Authorization header. No framework.
// Everything a client chose (topic names, client ids, users) is put in the page as text, never as HTML.
"use strict";

const TOKEN_KEY = "fanout.admin.token";
const HISTORY = 120;          // samples kept for the chart (2 minutes at the default 1 s interval)
const LINES = 8;              // clients drawn as lines; the rest are summed into the "others" band
const PALETTE = ["#4fb3ff", "#47c97a", "#f0b429", "#ef5b5b", "#b48cff", "#3dd6c6", "#ff8fd0", "#c0d84b",
                 "#ff9f43", "#8fa8ff"];
const OTHERS_COLOR = "#5b6b7d";

const $ = (id) => document.getElementById(id);
let token = null;
let stream = null;            // the AbortController of the open stream
let retryTimer = null;
const samples = [];           // [{t, rates: Map(id -> rate), total}]
let lastSnapshot = null;

// -- token: a form, sessionStorage, or #token=... (never a query string: it would reach logs) -----------

function takeTokenFromFragment() {
  const params = new URLSearchParams(location.hash.slice(1));
  const given = params.get("token");
  if (given) {
    sessionStorage.setItem(TOKEN_KEY, given);
    dropFragment();
  }
}

function dropFragment() {
  // drop the token from the address bar (and from what a screenshot or a shoulder sees)
  window.history.replaceState(null, "", location.pathname + location.search);
}

function showLogin(message) {
  $("login").hidden = false;
  $("dashboard").hidden = true;
  $("logout").hidden = true;
  $("login-error").textContent = message || "";
  $("token").focus();
}

function start() {
  token = sessionStorage.getItem(TOKEN_KEY);
  if (!token) {
    setStatus("idle", "no token");
    showLogin();
    return;
  }
  $("login").hidden = true;
  $("dashboard").hidden = false;
  $("logout").hidden = false;
  connect();
}

function stop() {
  if (stream) stream.abort();
  stream = null;
  clearTimeout(retryTimer);
}

$("login").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, $("token").value.trim());
  $("token").value = "";
  start();
});

$("logout").addEventListener("click", () => {
  stop();
  sessionStorage.removeItem(TOKEN_KEY);
  setStatus("idle", "no token");
  showLogin();
});

function headers(extra) {
  return Object.assign({ "Authorization": "Bearer " + token }, extra || {});
}

function setStatus(state, text) {
  const el = $("status");
  el.dataset.state = state;
  el.textContent = text || state;
}

// -- the stream -----------------------------------------------------------------------------------------

async function connect() {
  stop();
  const controller = new AbortController();
  stream = controller;
  setStatus("connecting");
  let response;
  try {
    response = await fetch("/api/stats/stream", { headers: headers(), cache: "no-store", signal: controller.signal });
  } catch (err) {
    return retry(controller, 2000, "unreachable");
  }
  if (response.status === 401) {
    stop();
    sessionStorage.removeItem(TOKEN_KEY);
    setStatus("unauthorized");
    showLogin("The gateway refused this token.");
    return;
  }
  if (response.status === 429) {
    return retry(controller, 5000, "too many viewers, retrying");
  }
  if (!response.ok || !response.body) {
    return retry(controller, 3000, "HTTP " + response.status);
  }
  setStatus("live");
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
        if (data) render(JSON.parse(data));
      }
    }
  } catch (err) {
    if (controller.signal.aborted) return;
  }
  retry(controller, 1000, "stream ended, reconnecting");
}

function retry(controller, delay, why) {
  if (stream !== controller) return;  // replaced or stopped meanwhile
  setStatus("retrying", why);
  retryTimer = setTimeout(connect, delay);
}

// -- formatting -----------------------------------------------------------------------------------------

function rate(x) {
  if (x === null || x === undefined) return "—";
  if (x === 0) return "0";
  return x >= 100 ? x.toFixed(0) : x >= 10 ? x.toFixed(1) : x.toFixed(2);
}

function count(x) {
  if (x === null || x === undefined) return "—";
  return x >= 1e9 ? (x / 1e9).toFixed(1) + "G" : x >= 1e6 ? (x / 1e6).toFixed(1) + "M"
    : x >= 1e4 ? (x / 1e3).toFixed(1) + "k" : String(x);
}

function seconds(s) {
  if (s >= 1) return s + " s";
  if (s >= 0.001) return +(s * 1000).toPrecision(3) + " ms";
  return +(s * 1e6).toPrecision(3) + " µs";
}

// a drawn client keeps its colour while it stays drawn; two drawn clients never share one
const colours = new Map();

function assignColours(ids) {
  for (const id of [...colours.keys()]) if (!ids.includes(id)) colours.delete(id);
  for (const id of ids) {
    if (colours.has(id)) continue;
    const used = new Set(colours.values());
    colours.set(id, PALETTE.find((c) => !used.has(c)) || PALETTE[colours.size % PALETTE.length]);
  }
}

function colorOf(id) {
  return colours.get(id) || PALETTE[0];
}

function cell(text, cls) {
  const td = document.createElement("td");
  td.textContent = text === null || text === undefined ? "—" : String(text);
  if (cls) td.className = cls;
  return td;
}

function button(text, cls, onclick) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = text;
  if (cls) b.className = cls;
  b.addEventListener("click", onclick);
  return b;
}

// -- rendering ------------------------------------------------------------------------------------------

// With a broker the snapshot has `cluster`: every node's clients, counts and rates merged (the busiest
// clients of the whole cluster, each with its node). The cards, the chart and the clients table show the
// cluster then; the topics, histograms and raw panels stay this node's.
function view(s) {
  const c = s.cluster;
  if (!c) return { clients: s.clients, others: s.others, fairness: s.fairness, totals: s.totals, nodes: null };
  const totals = Object.assign({}, s.totals, {
    clients: c.totals.clients, clients_by_transport: c.totals.clients_by_transport,
    write_blocked: c.totals.write_blocked, delivered_per_s: c.totals.delivered_per_s,
    client_delivery_per_s: c.totals.client_delivery_per_s,
  });
  // each card's total in the same scope as its rate: delivered is the cluster's, the others this node's
  if (c.totals.counters && s.totals.counters) {
    totals.counters = Object.assign({}, s.totals.counters,
      { messages_delivered: c.totals.counters.messages_delivered });
  }
  return { clients: c.clients, others: c.others, fairness: c.fairness, totals, nodes: c.totals.nodes };
}

// The stream's first sample has no rates (dt is null: a rate is the difference of two samples), but every
// count is already there; the rate cards show what was counted since start beneath.
function firstSample() {
  return lastSnapshot !== null && lastSnapshot.dt === null;
}

function render(s) {
  lastSnapshot = s;
  $("instance").textContent = s.instance;
  $("node-meta").hidden = !s.node;
  $("node").textContent = s.node || "—";
  $("updated").textContent = new Date(s.time * 1000).toLocaleTimeString();
  $("viewers").textContent = s.viewers;
  const v = view(s);
  renderCards(v);
  renderNodes(s.cluster);
  remember(s, v);
  drawChart();
  renderHistogram("h-cycle", s.histograms.cycle_seconds, seconds);
  renderHistogram("h-batch", s.histograms.entries_per_batch, (b) => String(b));
  renderTopics(s);
  renderClients(v);
  renderRaw(s.raw);
}

function renderCards(s) {
  const t = s.totals;
  $("c-clients").textContent = count(t.clients);
  $("c-transports").textContent = (s.nodes ? s.nodes + " node" + (s.nodes === 1 ? "" : "s") + " · " : "")
    + Object.entries(t.clients_by_transport).filter(([, n]) => n > 0).map(([k, n]) => k + " " + n).join(" · ");
  $("c-topics").textContent = count(t.topics);
  const counted = t.counters || {};
  for (const [card, perSecond, counter] of [["published", t.published_per_s, "messages_published"],
    ["delivered", t.delivered_per_s, "messages_delivered"], ["lost", t.lost_per_s, "messages_lost"],
    ["cycles", t.cycles_per_s, "cycles"]]) {
    $("c-" + card).textContent = rate(perSecond);
    $("c-" + card + "-total").textContent = counted[counter] === undefined ? ""
      : count(counted[counter]) + " since start";
  }
  // amber only for what needs a look: messages lost to a client, connections that cannot be written to
  $("c-lost").parentElement.classList.toggle("warn", t.lost_per_s > 0);
  $("c-bytes").textContent = rate(t.ws_bytes_per_s);
  $("c-bytes-ratio").textContent = t.ws_wire_ratio === null || t.ws_wire_ratio === undefined ? ""
    : Math.round(t.ws_wire_ratio * 100) + "% of payload on the wire";
  $("c-blocked").textContent = count(t.write_blocked);
  $("c-blocked").parentElement.classList.toggle("warn", t.write_blocked > 0);
  const f = s.fairness;
  $("c-jain").textContent = f.jain === null ? "—" : f.jain.toFixed(3);
  $("c-spread").textContent = (f.clients ? f.clients + " clients, lowest share " + f.share_min.toFixed(2) : "")
    + (f.receiving ? (f.clients ? " · " : "") + rate(f.min) + " – " + rate(f.max) + "/s" : "")
    || (firstSample() ? "after the next sample" : "nobody had anything waiting");
}

function renderHistogram(id, h, label) {
  const recent = h.recent && h.recent.some((n) => n > 0);
  const counts = recent ? h.recent : h.counts;
  $(id + "-note").textContent = recent ? "last interval" : "since start";
  const max = Math.max(1, ...counts);
  const rows = [];
  counts.forEach((n, i) => {
    const bound = i < h.bounds.length ? "≤ " + label(h.bounds[i]) : "> " + label(h.bounds[h.bounds.length - 1]);
    const b = document.createElement("span");
    b.className = "b";
    b.textContent = bound;
    const wrap = document.createElement("span");
    const bar = document.createElement("div");
    bar.className = "bar";
    bar.style.width = (100 * n / max).toFixed(1) + "%";
    if (n === 0) bar.style.opacity = "0";
    wrap.appendChild(bar);
    const c = document.createElement("span");
    c.className = "n";
    c.textContent = count(n);
    rows.push(b, wrap, c);
  });
  $(id).replaceChildren(...rows);
}

// A ring holds [begin, end): end - begin messages (at most its capacity once it has wrapped). Full is the
// steady state of a busy ring, not a warning.
function ringFill(t) {
  const held = t.end - t.begin;
  const gauge = document.createElement("span");
  gauge.className = "fill";
  const bar = document.createElement("span");
  bar.style.width = Math.min(100, 100 * held / t.capacity).toFixed(1) + "%";
  gauge.appendChild(bar);
  const seqs = held > 0 ? "seqs " + t.begin + "–" + (t.end - 1) : "empty, next seq " + t.end;
  return [gauge, document.createTextNode(held + " / " + t.capacity + " (" + seqs + ")")];
}

function renderTopics(s) {
  // with a broker the rows are this node's topics, and their subscribers the ones connected here
  $("th-subscribers").textContent = s.node ? "subscribers (this node)" : "subscribers";
  const rows = [...s.topics].sort((a, b) => a.name < b.name ? -1 : a.name > b.name ? 1 : 0).map((t) => {
    const tr = document.createElement("tr");
    tr.dataset.topic = t.name;
    tr.append(cell(t.name), cell(t.kind), cell(rate(t.rate), "num rate"), cell(t.subscribers, "num count"));
    const fill = document.createElement("td");
    fill.className = "fill-cell";
    if (t.kind === "ring") {
      fill.append(...ringFill(t));
    } else if (t.kind === "snapshot") {
      fill.textContent = "seq " + t.seq;
    } else {
      fill.textContent = (t.queued ?? 0) + " queued";
    }
    tr.append(fill, cell(t.epoch));
    const actions = document.createElement("td");
    actions.appendChild(button("publish…", "", () => {
      $("pub-topic").value = t.name;
      $("pub-data").focus();
    }));
    tr.appendChild(actions);
    return tr;
  });
  $("topics").tBodies[0].replaceChildren(...rows);
  const more = s.others.topics;
  $("topics-more").textContent = s.totals.topics + " in all" + (s.node ? " on this node" : "")
    + (more ? ", the " + s.topics.length + " busiest shown, " + more + " more" : "");
}

function renderNodes(cluster) {
  $("nodes-panel").hidden = !cluster;
  if (!cluster) return;
  const rows = cluster.nodes.map((n) => {
    const tr = document.createElement("tr");
    tr.dataset.node = n.node;
    if (n.node === lastSnapshot.node) tr.className = "self";
    tr.append(cell(n.node, "mono"), cell(n.pid, "num"), cell(count(n.clients), "num"), cell(count(n.topics), "num"),
      cell(rate(n.published_per_s), "num"), cell(rate(n.delivered_per_s), "num"),
      cell(rate(n.client_delivery_per_s), "num"), cell(n.write_blocked, "num"),
      cell(n.age_s === null ? null : n.age_s.toFixed(1), "num"));
    return tr;
  });
  $("nodes").tBodies[0].replaceChildren(...rows);
  const waiting = cluster.nodes.filter((n) => n.listed === null).length;
  $("nodes-note").textContent = cluster.error ? "other nodes unreadable: " + cluster.error
    : cluster.nodes.length + " live" + (waiting ? ", " + waiting + " without a client summary yet" : "");
  $("nodes-note").className = cluster.error ? "error" : "dim";
}

function renderClients(s) {
  for (const th of document.querySelectorAll("#clients .node-col")) th.hidden = !s.nodes;
  const rows = [...s.clients].sort((a, b) => a.id < b.id ? -1 : a.id > b.id ? 1 : 0).map((c) => {
    const tr = document.createElement("tr");
    tr.dataset.client = c.id;
    const blocked = c.write_blocked === true;
    if (blocked) tr.className = "blocked";
    const state = blocked ? "blocked" : c.state;
    const batches = c.frames_sent ?? c.batches;
    tr.append(cell(c.id));
    if (s.nodes) {
      tr.dataset.node = c.node;
      tr.append(cell(c.node, "node-col mono"));
    }
    tr.append(cell(c.transport), cell(c.user), cell(state, "state-" + state), cell(c.lag, "num count"),
      cell(c.subscription_count, "num count"), cell(count(batches), "num count"),
      cell(count(c.entries_sent), "num count"), cell(rate(c.rate), "num rate"));
    const actions = document.createElement("td");
    actions.appendChild(button("kick", "danger", () => kick(c.id)));
    tr.appendChild(actions);
    return tr;
  });
  $("clients").tBodies[0].replaceChildren(...rows);
  const more = s.others.clients;
  $("clients-more").textContent = s.totals.clients + " connected" + (more ? ", the " + s.clients.length
    + " busiest shown, " + more + " more at " + rate(s.others.rate) + "/s" : "");
}

function renderRaw(raw) {
  $("raw").hidden = !raw;
  if (!raw) return;
  const kv = Object.entries(raw.stats).filter(([, v]) => v === null || typeof v !== "object").map(([k, v]) => {
    const span = document.createElement("span");
    const b = document.createElement("b");
    b.textContent = typeof v === "number" ? count(v) : String(v);
    span.append(k.replaceAll("_", " ") + " ", b);
    return span;
  });
  $("raw-stats").replaceChildren(...kv);
  $("raw-summary").textContent = raw.receivers.length + " receiver" + (raw.receivers.length === 1 ? "" : "s")
    + " · " + count(raw.stats.bytes_sent) + " bytes sent";
  const rows = raw.receivers.map((r) => {
    const tr = document.createElement("tr");
    tr.append(cell(r.id, "mono"), cell(Array.isArray(r.peer) ? r.peer.join(":") : r.peer),
      cell(r.state, "lag-" + r.state), cell(count(r.lag), "num"), cell(count(r.bytes_sent), "num"),
      cell(count(r.in_flight), "num"), cell(r.write_paused ? "yes" : "no"));
    return tr;
  });
  $("raw-receivers").tBodies[0].replaceChildren(...rows);
}

// -- the fairness chart: one line per busy client, the others as a band -------------------------------------

function remember(s, v) {
  if (s.dt === null) return;  // the first snapshot has no rates yet
  const rates = new Map();
  for (const c of v.clients) if (c.rate !== null) rates.set(c.id, c.rate);
  samples.push({ t: s.time, rates, total: v.totals.client_delivery_per_s || 0 });
  if (samples.length > HISTORY) samples.shift();
}

function chosenLines() {
  const last = samples[samples.length - 1];
  if (!last) return [];
  // the busiest clients now; a client that stopped stays drawn while it is among the busiest of the window
  const peak = new Map();
  for (const sample of samples) for (const [id, r] of sample.rates) peak.set(id, Math.max(peak.get(id) || 0, r));
  return [...peak.entries()].filter(([id]) => last.rates.has(id) || peak.get(id) > 0)
    .sort((a, b) => (last.rates.get(b[0]) || 0) - (last.rates.get(a[0]) || 0) || b[1] - a[1])
    .slice(0, LINES).map(([id]) => id);
}

function niceMax(v) {
  if (v <= 0) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

function drawChart() {
  const canvas = $("rate-chart");
  const dpr = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || 800;
  const height = canvas.clientHeight || 260;
  if (canvas.width !== Math.round(width * dpr) || canvas.height !== Math.round(height * dpr)) {
    canvas.width = Math.round(width * dpr);
    canvas.height = Math.round(height * dpr);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, width, height);
  const pad = { l: 52, r: 12, t: 10, b: 22 };
  const w = width - pad.l - pad.r;
  const h = height - pad.t - pad.b;
  const lines = chosenLines();
  assignColours(lines);
  const others = samples.map((s) => {
    let drawn = 0;
    for (const id of lines) drawn += s.rates.get(id) || 0;
    return Math.max(0, s.total - drawn);
  });
  let top = 0;
  samples.forEach((s, i) => {
    top = Math.max(top, others[i]);
    for (const id of lines) top = Math.max(top, s.rates.get(id) || 0);
  });
  top = niceMax(top * 1.05);
  const x = (i) => pad.l + (samples.length <= 1 ? w : (w * (i + HISTORY - samples.length)) / (HISTORY - 1));
  const y = (v) => pad.t + h - (h * v) / top;

  ctx.font = "11px system-ui, sans-serif";
  ctx.strokeStyle = "#263241";
  ctx.fillStyle = "#7d8b9c";
  ctx.lineWidth = 1;
  for (let k = 0; k <= 4; k++) {
    const v = (top * k) / 4;
    const yy = Math.round(y(v)) + 0.5;
    ctx.beginPath();
    ctx.moveTo(pad.l, yy);
    ctx.lineTo(pad.l + w, yy);
    ctx.stroke();
    ctx.textAlign = "right";
    ctx.fillText(rate(v), pad.l - 6, yy + 4);
  }
  const interval = lastSnapshot ? lastSnapshot.interval_s : 1;
  ctx.textAlign = "center";
  for (let k = 0; k <= 4; k++) {
    const i = ((HISTORY - 1) * k) / 4;
    const ago = (HISTORY - 1 - i) * interval;
    ctx.fillText(ago ? "-" + Math.round(ago) + " s" : "now", pad.l + (w * i) / (HISTORY - 1), height - 6);
  }

  let points = 0;
  if (samples.length) {
    ctx.fillStyle = OTHERS_COLOR;
    ctx.globalAlpha = 0.45;
    ctx.beginPath();
    ctx.moveTo(x(0), y(0));
    others.forEach((v, i) => ctx.lineTo(x(i), y(v)));
    ctx.lineTo(x(samples.length - 1), y(0));
    ctx.closePath();
    ctx.fill();
    ctx.globalAlpha = 1;
    points += others.length;
  }
  ctx.lineWidth = 1.8;
  for (const id of lines) {
    ctx.strokeStyle = colorOf(id);
    ctx.beginPath();
    let pen = false;
    samples.forEach((s, i) => {
      const v = s.rates.get(id);
      if (v === undefined) { pen = false; return; }
      if (pen) ctx.lineTo(x(i), y(v)); else ctx.moveTo(x(i), y(v));
      pen = true;
      points++;
    });
    ctx.stroke();
  }
  if (!samples.length) {  // nothing to draw before a second sample: say so rather than an empty frame
    ctx.fillStyle = "#7d8b9c";
    ctx.font = "13px system-ui, sans-serif";
    ctx.fillText(firstSample() ? "rates from the next sample on (in " + lastSnapshot.interval_s + " s)"
      : "no sample yet", pad.l + w / 2, pad.t + h / 2);
  }
  canvas.dataset.points = String(points);
  canvas.dataset.series = String(lines.length + (samples.length ? 1 : 0));
  renderLegend(lines, others[others.length - 1]);
}

function renderLegend(lines, othersNow) {
  const last = samples[samples.length - 1];
  const items = lines.map((id) => {
    const li = document.createElement("li");
    const swatch = document.createElement("i");
    swatch.style.background = colorOf(id);
    li.append(swatch, id + "  " + rate(last ? last.rates.get(id) : null) + "/s");
    return li;
  });
  const li = document.createElement("li");
  li.className = "band";
  const swatch = document.createElement("i");
  swatch.style.background = OTHERS_COLOR;
  li.append(swatch, "others  " + rate(othersNow ?? null) + "/s");
  items.push(li);
  $("legend").replaceChildren(...items);
}

window.addEventListener("resize", () => { if (lastSnapshot) drawChart(); });

// -- actions: kick, publish ------------------------------------------------------------------------------

async function kick(id) {
  if (!window.confirm("Disconnect " + id + " (close code 4000)?")) return;
  const r = await fetch("/api/clients/" + encodeURIComponent(id), { method: "DELETE", headers: headers() });
  if (!r.ok) window.alert("kick failed: " + (await errorText(r)));
}

async function errorText(r) {
  try {
    const body = await r.json();
    return body.error ? body.error.code + ": " + body.error.message : "HTTP " + r.status;
  } catch (err) {
    return "HTTP " + r.status;
  }
}

$("publish").addEventListener("submit", async (event) => {
  event.preventDefault();
  const result = $("pub-result");
  const topic = $("pub-topic").value.trim();
  let data;
  try {
    data = JSON.parse($("pub-data").value);
  } catch (err) {
    result.textContent = "data is not JSON: " + err.message;
    return;
  }
  const body = { data };
  const client = $("pub-client").value.trim();
  if (client) body.client = client;
  const r = await fetch("/api/topics/" + encodeURIComponent(topic) + "/publish", {
    method: "POST", headers: headers({ "Content-Type": "application/json" }), body: JSON.stringify(body),
  });
  result.textContent = r.ok ? "published to " + topic + ", seq " + (await r.json()).seqs.join(", ")
    : "refused: " + (await errorText(r));
});

takeTokenFromFragment();
start();
