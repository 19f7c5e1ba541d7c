// The dashboard page: polls api/v1/state and redraws. No framework, no CDN.
// Every value from the swarm goes into the DOM as text (textContent), never as HTML:
// public names and error messages are written by strangers.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";
let refreshSeconds = 5;
// The servers table shows one page of rows: the API sends only that page (?page=N&per_page=M), so a
// swarm of 1,000 servers costs the page 100 rows to draw and a tenth of the JSON per refresh.
const PER_PAGE = 100;
let serversPage = 1;
let refreshTimer = null;

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  setAttrs(el, attrs);
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

function s(tag, attrs) {
  const el = document.createElementNS(SVG_NS, tag);
  setAttrs(el, attrs);
  return el;
}

function setAttrs(el, attrs) {
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value !== null && value !== undefined && value !== false) el.setAttribute(key, String(value));
  }
}

// ---- formatting ------------------------------------------------------------------------------

function num(x, digits = 1) {
  if (x === null || x === undefined || !isFinite(x)) return "–";
  if (Math.abs(x) >= 1e6) return (x / 1e6).toFixed(digits) + "M";
  if (Math.abs(x) >= 1e4) return (x / 1e3).toFixed(digits) + "k";
  return x.toFixed(digits);
}

function int(x) {
  return x === null || x === undefined ? "–" : Math.round(x).toLocaleString("en-US");
}

function compact(x) {
  return x === null || x === undefined ? "–" : x < 1e4 ? String(Math.round(x)) : num(x, 1);
}

function duration(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return s + " s";
  if (s < 3600) return Math.floor(s / 60) + " min";
  if (s < 86400) return (s / 3600).toFixed(1) + " h";
  return (s / 86400).toFixed(1) + " d";
}

function ms(seconds) {
  return seconds === null || seconds === undefined ? "–" : (seconds * 1000).toFixed(seconds < 0.01 ? 1 : 0) + " ms";
}

function pct(x) {
  return x === null || x === undefined ? "–" : (x * 100).toFixed(x >= 0.995 || x === 0 ? 0 : 1) + "%";
}

function shortId(peerId) {
  return peerId.length > 12 ? "…" + peerId.slice(-8) : peerId;
}

// ---- charts ----------------------------------------------------------------------------------

function sparkline(points, key, title, format, fixedMax) {
  const width = 300, height = 70, pad = 4;
  const values = points.map((p) => p[key]);
  const max = fixedMax || Math.max(1e-9, ...values);
  const t0 = points.length ? points[0].at : 0;
  const span = points.length > 1 ? points[points.length - 1].at - t0 : 1;
  const x = (p) => pad + ((p.at - t0) / span) * (width - 2 * pad);
  const y = (v) => height - pad - (v / max) * (height - 2 * pad);
  const svg = s("svg", { viewBox: `0 0 ${width} ${height}`, preserveAspectRatio: "none", role: "img", "aria-label": title });
  if (points.length === 1) {
    svg.append(s("line", { class: "line", x1: pad, x2: width - pad, y1: y(values[0]), y2: y(values[0]) }));
  } else if (points.length > 1) {
    const coords = points.map((p) => `${x(p).toFixed(1)},${y(p[key]).toFixed(1)}`);
    svg.append(s("polygon", { class: "area", points: `${pad},${height - pad} ${coords.join(" ")} ${width - pad},${height - pad}` }));
    svg.append(s("polyline", { class: "line", points: coords.join(" ") }));
  }
  const last = values.length ? format(values[values.length - 1]) : "no data yet";
  const hours = points.length > 1 ? ` over ${duration(span)}` : "";
  return h("div", { class: "chart" }, h("div", { class: "muted" }, `${title}: ${last}${hours}`), svg);
}

// ---- sections --------------------------------------------------------------------------------

function figure(value, label) {
  return h("div", { class: "figure" }, h("b", null, value), h("span", null, label));
}

function blockMap(model) {
  const maxTp = Math.max(1e-9, ...model.blocks.map((b) => b.throughput));
  const cells = model.blocks.map((b) =>
    h("div", {
        class: "block" + (b.servers >= 4 ? " many" : ""),
        "data-block": b.block, "data-servers": b.servers, "data-throughput": b.throughput,
        title: `block ${b.block}: ${b.servers} server${b.servers === 1 ? "" : "s"}, ${num(b.throughput)} tokens/s`,
      },
      h("span", { class: "n" }, b.servers), h("span", { class: "i" }, b.block),
      h("span", { class: "tp", style: `width:${((b.throughput / maxTp) * 100).toFixed(0)}%` })));
  const legend = h("div", { class: "legend" },
    [["c0", "no server"], ["c1", "1"], ["c2", "2"], ["c3", "3"], ["c4", "4+ servers"]].map(([c, label]) =>
      h("span", null, h("i", { style: `background:var(--${c})` }), label)),
    h("span", null, "big number: servers · small: block · bar: total tokens/s"));
  return [h("div", { class: "blockmap" }, cells), legend];
}

function timeline(points) {
  return h("span", { class: "timeline", title: "state per interval, oldest left" },
    points.slice(-30).map((p) => h("i", { class: p.state, title: `${new Date(p.at * 1000).toLocaleTimeString()}: ${p.state}` })));
}

function pings(server) {
  const entries = Object.entries(server.next_pings || {});
  if (!entries.length) return "–";
  entries.sort((a, b) => a[1] - b[1]);  // fastest first; the cell's title lists them all
  const shown = entries.slice(0, 3).map(([peer, rtt]) => `${shortId(peer)} ${ms(rtt)}`).join(", ");
  return entries.length > 3 ? `${shown} +${entries.length - 3} more` : shown;
}

// 12 columns, so that a 1280-pixel page shows every one without scrolling sideways
const SERVER_COLUMNS = [
  ["Peer", "peer"], ["Name", "name"], ["Span", "span"], ["State", "state"], ["Uptime · availability", "availability"],
  ["Throughput", "throughput", "num"], ["dtype · quant. · LoRA", "dtype"], ["Cache left", "cache", "num"],
  ["Sessions", "sessions", "num"], ["Network", "network"], ["Pings to next", "pings"],
  ["Laps · tok/lap · cancels", "laps", "num"],
];

// clients whose spot-checks caught the server lying (docs/dashboard.md): anybody's claims, a signal
function disputed(sv) {
  if (!(sv.disputed_by > 0)) return [];
  const title = `${sv.disputed_by} client${sv.disputed_by === 1 ? "" : "s"} reported that this server's outputs lost a ` +
    "spot-check (they disagreed with two other servers of the same blocks). Anyone can report: a signal, not proof.";
  return [" ", h("span", { class: "dispute", "data-disputed-by": sv.disputed_by, title }, `disputed by ${sv.disputed_by}`)];
}

// the LoRA adapters a server serves (--adapters; clients pick one with active_adapter), listed by name
function adapters(sv) {
  const names = sv.adapters || [];
  return names.length ? [h("div", { class: "adapters", title: "LoRA adapters (--adapters)" }, "LoRA: " + names.join(", "))] : [];
}

function serverRow(sv) {
  const cell = (col, content, title) => h("td", { "data-col": col, class: SERVER_COLUMNS.find((c) => c[1] === col)[2], title }, content);
  const tokensPerLap = sv.laps_served ? num(sv.accepted_tokens / sv.laps_served, 2) : "–";
  const network = (sv.using_relay ? "relay" : "direct") + (sv.rtt !== null ? ` · ${ms(sv.rtt)}` : sv.probe_error ? " · unreachable" : "");
  const laps = sv.is_tail ? `${int(sv.laps_served)} · ${tokensPerLap}` : "– · –";
  return h("tr", { "data-peer": sv.peer_id, "data-state": sv.state },
    cell("peer", h("code", null, shortId(sv.peer_id)), `${sv.peer_id}\nversion ${sv.version || "unknown"}`),
    cell("name", sv.public_name || "–"),
    cell("span", `${sv.start_block}:${sv.end_block}`),
    cell("state", [h("span", { class: "state " + sv.state }, sv.state), ...disputed(sv),
      ...(sv.compatible === false ? [" ", h("span", { class: "incompatible", title: "routers skip it" }, `protocol v${sv.protocol_version}`)] : [])]),
    cell("availability", [duration(sv.uptime_seconds), " ", timeline(sv.uptime_timeline), " ", pct(sv.availability)]),
    cell("throughput", num(sv.throughput) + " tok/s"),
    cell("dtype", [sv.quantization ? `${sv.dtype} · ${sv.quantization}` : sv.dtype, ...adapters(sv)]),
    cell("cache", `${compact(sv.free_cache_tokens)} / ${compact(sv.cache_tokens)}`, `${int(sv.free_cache_tokens)} of ${int(sv.cache_tokens)} tokens free`),
    cell("sessions", int(sv.open_sessions)),
    cell("network", network, sv.probe_error || ""),
    cell("pings", pings(sv), Object.entries(sv.next_pings || {}).map(([p, r]) => `${p}: ${ms(r)}`).join("\n")),
    cell("laps", `${laps} · ${int(sv.cancelled_runs)}`, "laps answered (tail) · tokens per lap (tail) · runs cancelled"));
}

function serversTable(model) {
  const head = h("tr", null, SERVER_COLUMNS.map(([label, col, cls]) => h("th", { class: cls, "data-col": col }, label)));
  return [pager(model.servers_page, model.servers.length), h("div", { class: "scroll" },
    h("table", { class: "servers" }, h("thead", null, head), h("tbody", null, model.servers.map(serverRow))))];
}

// "servers 101–200 of 900 · page 2 of 9" with previous/next buttons; nothing when one page holds every row
function pager(page, shown) {
  if (!page || page.pages <= 1) return null;
  const first = (page.page - 1) * page.per_page + 1;
  const go = (to) => () => { serversPage = Math.max(1, Math.min(page.pages, to)); refresh(); };
  const button = (label, to, disabled) => h("button", { type: "button", disabled, "data-page": to }, label);
  const prev = button("‹ previous", page.page - 1, page.page <= 1);
  const next = button("next ›", page.page + 1, page.page >= page.pages);
  prev.addEventListener("click", go(page.page - 1));
  next.addEventListener("click", go(page.page + 1));
  return h("div", { class: "pager", "data-page": page.page, "data-pages": page.pages }, prev,
    h("span", { class: "muted" }, `servers ${int(first)}–${int(first + shown - 1)} of ${int(page.total)} · page ${page.page} of ${page.pages}`),
    next);
}

function modelCard(model) {
  const spec = model.speculation;
  const status = model.healthy ? "healthy" : "broken";
  const why = model.num_blocks === null ? "number of blocks unknown"
    : model.missing_blocks.length ? `no server for block${model.missing_blocks.length > 1 ? "s" : ""} ${model.missing_blocks.join(", ")}` : "";
  return h("section", { class: "card model", "data-model": model.name, "data-healthy": model.healthy },
    h("div", { class: "model-head" },
      h("h2", null, model.name), h("span", { class: "badge " + status }, status), why && h("span", { class: "muted" }, why)),
    h("div", { class: "figures" },
      figure(num(model.max_flow) + " tok/s", "max-flow through all blocks"),
      figure(num(model.throughput) + " tok/s", "total server throughput"),
      figure(`${model.servers_online} / ${model.servers_total}`, "servers online"),
      figure(model.num_blocks === null ? "?" : `${model.num_blocks - model.missing_blocks.length} / ${model.num_blocks}`, "blocks covered"),
      figure(spec.tokens_per_lap === null ? "–" : num(spec.tokens_per_lap, 2), "tokens per lap (tail)"),
      figure(`${int(spec.laps_served)} · ${int(spec.cancelled_runs)}`, "laps served · cancels")),
    h("h3", null, "Blocks"), blockMap(model),
    h("h3", null, "History"),
    h("div", { class: "charts" },
      sparkline(model.history, "coverage", "Coverage", pct, 1),
      sparkline(model.history, "max_flow", "Max-flow", (v) => num(v) + " tok/s"),
      sparkline(model.history, "throughput", "Throughput", (v) => num(v) + " tok/s")),
    h("h3", null, "Servers"), serversTable(model));
}

function contributors(rows, total) {
  const table = document.getElementById("contributors");
  const more = total > rows.length ? h("tr", null, h("td", { colspan: 5, class: "muted" }, `the first ${rows.length} of ${int(total)} names`)) : null;
  table.replaceChildren(
    h("thead", null, h("tr", null, h("th", null, "Name"), h("th", { class: "num" }, "Servers"),
      h("th", { class: "num" }, "Blocks"), h("th", { class: "num" }, "Throughput"), h("th", null, "Models"))),
    h("tbody", null, rows.length ? rows.map((r) => h("tr", null, h("td", null, r.public_name), h("td", { class: "num" }, r.servers),
      h("td", { class: "num" }, r.blocks), h("td", { class: "num" }, num(r.throughput) + " tok/s"), h("td", null, r.models.join(", "))))
      : h("tr", null, h("td", { colspan: 5, class: "muted" }, "no server online")), more));
}

function errors(list, now) {
  const ul = document.getElementById("errors");
  ul.replaceChildren(...(list.length ? list.map((e) =>
    h("li", null, h("span", { class: "muted" }, duration(now - e.at) + " ago "), h("code", { title: e.peer_id }, shortId(e.peer_id)),
      ` (${e.model}): ${e.message}`, e.count > 1 ? ` ×${e.count}` : "")) : [h("li", { class: "muted" }, "none")]));
}

// ---- loop ------------------------------------------------------------------------------------

function showBanner(text) {
  const banner = document.getElementById("banner");
  banner.hidden = !text;
  banner.textContent = text || "";
}

function render(state) {
  refreshSeconds = state.refresh_seconds || refreshSeconds;
  const updated = state.updated_at === null ? "waiting for the first read of the swarm"
    : `updated ${duration(state.now - state.updated_at)} ago`;
  document.getElementById("status").textContent = `${updated} · refreshes every ${refreshSeconds} s`;
  showBanner(state.error ? `The swarm could not be read (showing the last good state): ${state.error}` : "");
  const models = document.getElementById("models");
  models.replaceChildren(...(state.models.length ? state.models.map(modelCard)
    : [h("section", { class: "card muted" }, state.updated_at === null ? "Reading the swarm…" : "No model is served in this swarm right now.")]));
  contributors(state.top_contributors, state.contributors_total);
  errors(state.reachability_errors, state.now);
  document.body.dataset.updatedAt = String(state.updated_at);
}

async function refresh() {
  clearTimeout(refreshTimer);  // a page button refreshes at once; one timer stays pending
  try {
    const response = await fetch(`api/v1/state?page=${serversPage}&per_page=${PER_PAGE}`, { cache: "no-store" });
    const body = await response.json().catch(() => ({}));
    if (!response.ok) throw new Error(body.error || `HTTP ${response.status}`);
    render(body);
  } catch (e) {
    showBanner(`The dashboard server could not be reached: ${e.message}. Retrying…`);
  } finally {
    clearTimeout(refreshTimer);
    refreshTimer = setTimeout(refresh, refreshSeconds * 1000);
  }
}

refresh();
