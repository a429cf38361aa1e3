// Journeyman's run viewer: plain JavaScript, SVG charts, no library and nothing fetched from outside.
// Routes live in the URL's hash, so the same files work at / (`journeyman view`) and /view/
// (`journeyman serve`): every API call is relative to the page.
"use strict";

const POLL_MS = 2000;
const GROUPS_PER_PAGE = 20;
const STEPS_PER_PAGE = 25;
const COLORS = ["#2f6fdf", "#e07b00", "#1e8a4c", "#c2362f", "#7b4bc4", "#148f9b", "#9b6a14", "#d14b9a"];

const state = { route: null, version: null, zoom: {}, sort: {}, picked: null, poll: null };

// -- DOM helpers: text always goes in as text, never as HTML ----------------------------------------
function h(tag, attrs, ...kids) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "class") el.className = v;
    else el.setAttribute(k, v === true ? "" : v);
  }
  for (const kid of kids.flat(Infinity)) { // lists of lists of nodes (a badge and its space) too
    if (kid === null || kid === undefined || kid === false) continue;
    el.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
  }
  return el;
}
function svg(tag, attrs) {
  const el = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, v);
  return el;
}
// any JSON value as short text: numbers rounded, objects and arrays as JSON
const fmt = (x, d = 3) => (x === null || x === undefined ? "–" : typeof x === "number" ? (Number.isInteger(x) && Math.abs(x) < 1e6 ? String(x) : x.toPrecision(d)) : typeof x === "object" ? JSON.stringify(x) : String(x));
const signed = (x) => h("span", { class: x > 1e-9 ? "pos" : x < -1e-9 ? "neg" : "" }, (x > 0 ? "+" : "") + fmt(x));
const enc = encodeURIComponent;

async function api(path) {
  const res = await fetch("api/" + path, { cache: "no-store" });
  const body = await res.json();
  if (!res.ok) throw new Error((body.error && body.error.message) || res.statusText);
  return body;
}

// -- routing ----------------------------------------------------------------------------------
function parseRoute() {
  const [path, query] = location.hash.replace(/^#\/?/, "").split("?");
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  const q = new URLSearchParams(query || "");
  if (parts[0] === "run" && parts.length === 2) return { page: "run", run: parts[1], q };
  if (parts[0] === "run" && parts[2] === "step" && parts.length === 5)
    return { page: "step", run: parts[1], split: parts[3], file: parts[4], q };
  if (parts[0] === "run" && parts[2] === "traj" && parts.length === 7)
    return { page: "traj", run: parts[1], split: parts[3], file: parts[4], group: +parts[5], index: +parts[6], q };
  if (parts[0] === "run" && parts[2] === "compare" && parts.length === 6)
    return { page: "compare", run: parts[1], split: parts[3], file: parts[4], group: +parts[5], q };
  return { page: "runs", q };
}
const link = {
  run: (r) => `#/run/${enc(r)}`,
  step: (r, s, f) => `#/run/${enc(r)}/step/${enc(s)}/${enc(f)}`,
  traj: (r, s, f, g, i) => `#/run/${enc(r)}/traj/${enc(s)}/${enc(f)}/${g}/${i}`,
  compare: (r, s, f, g, a, b) => `#/run/${enc(r)}/compare/${enc(s)}/${enc(f)}/${g}` + (a !== undefined ? `?a=${a}&b=${b}` : ""),
};

function crumbs(items) {
  const nav = document.getElementById("crumbs");
  nav.replaceChildren(...items.flatMap(([text, href], i) => [i ? h("span", {}, "›") : null, href ? h("a", { href }, text) : h("span", {}, text)]).filter(Boolean));
}

async function render(keepScroll) {
  const route = (state.route = parseRoute());
  const main = document.getElementById("main");
  const y = window.scrollY;
  try {
    // the files' fingerprint before the data is read: a change after this point is caught by poll()
    const version = await versionOf(route);
    if (route === state.route) state.version = version;
    const page = { runs: pageRuns, run: pageRun, step: pageStep, traj: pageTraj, compare: pageCompare }[route.page];
    const content = await page(route);
    if (route !== state.route) return; // the user moved on while this page loaded
    main.replaceChildren(content);
    main.dataset.page = route.page;
  } catch (e) {
    main.replaceChildren(h("div", { class: "card" }, h("b", {}, "Could not load this page: "), String(e.message || e)));
  }
  if (keepScroll) window.scrollTo(0, y);
}

async function versionOf(route) {
  if (route.page === "runs") return JSON.stringify((await api("runs")).map((r) => r.version));
  return (await api(`runs/${enc(route.run)}/version`)).version;
}

// Live: poll the run's fingerprint (or the list of runs) and redraw when it changes.
async function poll() {
  const route = state.route;
  if (!route) return;
  const live = document.getElementById("live");
  try {
    const v = await versionOf(route);
    live.classList.remove("stale");
    live.textContent = "live";
    if (state.version !== null && v !== state.version && route === state.route) {
      await render(true);
      live.textContent = "live · updated " + new Date().toLocaleTimeString();
    }
  } catch (e) {
    live.classList.add("stale");
    live.textContent = "not reachable";
  }
}

// -- page: runs ---------------------------------------------------------------------------------
async function pageRuns() {
  crumbs([["runs", null]]);
  document.title = "Journeyman runs";
  const runs = await api("runs");
  if (!runs.length) return h("div", { class: "card" }, "No run directories here yet. A run appears as soon as it writes its history.");
  const rows = runs.map((r) =>
    h("tr", { class: "click", onclick: () => (location.hash = link.run(r.id)) },
      h("td", {}, r.project), h("td", {}, h("a", { href: link.run(r.id) }, r.name)), h("td", {}, r.base_model || "–"),
      h("td", { class: "num" }, fmt(r.step)),
      h("td", {}, Object.entries(r.latest).map(([k, v]) => h("span", { class: "badge" }, `${k} ${fmt(v)}`)).map((b) => [b, " "])),
      h("td", { class: "muted" }, r.path)));
  return h("div", {}, h("h1", {}, "Runs"),
    h("table", { id: "runs" }, h("thead", {}, h("tr", {}, ["project", "model", "base model", "step", "latest", "run directory"].map((t) => h("th", {}, t)))), h("tbody", {}, rows)));
}

// -- page: one run: curves and steps ---------------------------------------------------------------
const CHARTS = [
  ["reward", (k) => /(^|\/)reward$/.test(k)],
  ["validation", (k) => k.startsWith("val/") && !/_sem$|reward$|trajectories$|groups$/.test(k)],
  ["loss", (k) => /loss/.test(k)],
  ["KL", (k) => /(^|[/_])kl($|_)/.test(k)],
  ["staleness", (k) => /stale|lag|off_policy/.test(k)],
  ["timing (s)", (k) => /seconds$/.test(k)],
];

async function pageRun(route) {
  const [runs, history] = await Promise.all([api("runs"), api(`runs/${enc(route.run)}/history`)]);
  const run = runs.find((r) => r.id === route.run);
  if (!run) throw new Error("no such run: " + route.run);
  crumbs([["runs", "#/"], [`${run.project}/${run.name}`, null]]);
  document.title = `${run.name} · Journeyman`;
  const split = route.q.get("split") || (run.splits.includes("train") ? "train" : run.splits[0] || "train");
  const offset = +(route.q.get("offset") || 0);
  const steps = await api(`runs/${enc(run.id)}/steps?split=${enc(split)}&offset=${offset}&limit=${STEPS_PER_PAGE}`);

  const keys = [...new Set(history.flatMap((r) => Object.keys(r).filter((k) => k.includes("/") && plottable(r[k]))))].sort();
  const charts = h("div", { class: "charts" });
  for (const [title, test] of CHARTS) {
    const ks = keys.filter(test);
    if (ks.length) charts.append(chart(title, series(history, ks.slice(0, 8))));
  }
  const picker = h("select", { id: "metric", onchange: (e) => { state.picked = e.target.value; render(true); } },
    h("option", { value: "" }, "any metric…"), keys.map((k) => h("option", { value: k, selected: k === state.picked }, k)));
  if (state.picked && keys.includes(state.picked)) charts.append(chart(state.picked, series(history, [state.picked])));

  const tabs = h("div", { class: "tabs" }, run.splits.map((s) => h("button", { class: s === split ? "on" : "", onclick: () => (location.hash = link.run(run.id) + `?split=${enc(s)}`) }, s)));
  const stepRows = steps.items.map((s) => {
    const m = s.metrics || {};
    const pre = s.split + "/";
    return h("tr", { class: "click step-row", onclick: () => (location.hash = link.step(run.id, s.split, s.name)) },
      h("td", { class: "num" }, h("a", { href: link.step(run.id, s.split, s.name) }, String(s.step))),
      h("td", {}, s.status === "committed" ? "" : h("span", { class: "badge " + (s.status === "attempt" ? "live" : "err") }, s.status)),
      h("td", { class: "num" }, fmt(m[pre + "reward"])), h("td", { class: "num" }, fmt(m[pre + "reward_std"])),
      h("td", { class: "num" }, fmt(m[pre + "groups"] ?? m[pre + "trajectories"])),
      h("td", { class: "num" }, fmt(m[pre + "policy_loss"] ?? m[pre + "loss"])), h("td", { class: "num" }, fmt(m[pre + "train_seconds"])),
      h("td", { class: "num muted" }, (s.size / 1024).toFixed(1) + " KiB"), h("td", { class: "muted" }, new Date(s.mtime * 1000).toLocaleString()));
  });
  const pager = h("div", { class: "pager" },
    h("button", { disabled: offset <= 0, onclick: () => (location.hash = link.run(run.id) + `?split=${enc(split)}&offset=${Math.max(0, offset - STEPS_PER_PAGE)}`) }, "‹ newer"),
    h("span", { class: "muted" }, `${steps.total ? offset + 1 : 0}–${offset + steps.items.length} of ${steps.total} files`),
    h("button", { disabled: offset + STEPS_PER_PAGE >= steps.total, onclick: () => (location.hash = link.run(run.id) + `?split=${enc(split)}&offset=${offset + STEPS_PER_PAGE}`) }, "older ›"));
  return h("div", {},
    h("h1", {}, `${run.project}/${run.name}`, " ", h("span", { class: "muted" }, `step ${fmt(run.step)} · ${run.base_model || ""}`)),
    h("div", { class: "muted" }, run.path),
    run.spend ? h("div", { id: "spend" }, h("b", {}, "spent: "), run.spend) : null,
    h("h2", {}, "Curves ", h("span", { class: "muted" }, "(drag to zoom, double-click to reset) "), picker),
    history.length ? charts : h("p", { class: "muted" }, "history.jsonl has no rows yet."),
    h("h2", {}, "Steps"), tabs,
    h("table", { id: "steps" }, h("thead", {}, h("tr", {}, ["step", "", "reward", "reward std", "groups", "loss", "train s", "file", "written"].map((t, i) => h("th", { class: i > 1 && i < 8 ? "num" : "" }, t)))), h("tbody", {}, stepRows)),
    pager);
}

// a number a chart can place: past 1e300 its own padding and scaling overflow to Infinity
const plottable = (v) => Number.isFinite(v) && Math.abs(v) < 1e300;

function series(history, keys) {
  return keys.map((k, i) => ({
    name: k,
    color: COLORS[i % COLORS.length],
    points: history.filter((r) => plottable(r[k]) && plottable(r.step)).map((r) => [r.step, r[k]]),
  }));
}

// A line chart with hover (nearest step: every series' value) and zoom (drag a range of steps).
function chart(title, data) {
  const W = 440, H = 220, L = 46, R = 10, T = 8, B = 22;
  const all = data.flatMap((s) => s.points);
  const box = h("div", { class: "chart", "data-title": title });
  const legend = h("div", { class: "legend" }, data.map((s) => h("span", {}, h("i", { style: `background:${s.color}` }), s.name)));
  box.append(h("h3", {}, title, h("span", { class: "muted" }, state.zoom[title] ? "zoomed: double-click to reset" : "")), legend);
  if (!all.length) return box;
  let [x0, x1] = state.zoom[title] || [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
  if (x0 === x1) { x0 -= 0.5; x1 += 0.5; }
  const inView = all.filter((p) => p[0] >= x0 && p[0] <= x1);
  let y0 = Math.min(...inView.map((p) => p[1])), y1 = Math.max(...inView.map((p) => p[1]));
  if (!isFinite(y0)) { y0 = 0; y1 = 1; }
  if (y0 === y1) { y0 -= Math.abs(y0) * 0.1 || 0.5; y1 += Math.abs(y1) * 0.1 || 0.5; }
  const pad = (y1 - y0) * 0.06; y0 -= pad; y1 += pad;
  const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const sy = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none" });
  const clip = "c" + Math.random().toString(36).slice(2);
  const defs = svg("defs"); const cp = svg("clipPath", { id: clip }); cp.append(svg("rect", { x: L, y: T, width: W - L - R, height: H - T - B })); defs.append(cp); root.append(defs);
  for (let i = 0; i <= 4; i++) {
    const yv = y0 + ((y1 - y0) * i) / 4, y = sy(yv);
    root.append(svg("line", { x1: L, x2: W - R, y1: y, y2: y, stroke: "#eceef1" }));
    const t = svg("text", { x: L - 4, y: y + 3, "text-anchor": "end", "font-size": 9, fill: "#6b7078" }); t.textContent = fmt(yv, 3); root.append(t);
  }
  // steps are integers: ticks on whole steps, about six of them
  const every = Math.max(1, Math.ceil((x1 - x0) / 6));
  for (let xv = Math.ceil(x0 / every) * every; xv <= x1; xv += every) {
    const t = svg("text", { x: sx(xv), y: H - 6, "text-anchor": "middle", "font-size": 9, fill: "#6b7078" }); t.textContent = String(xv); root.append(t);
  }
  const g = svg("g", { "clip-path": `url(#${clip})` });
  for (const s of data) {
    const pts = s.points.filter((p) => p[0] >= x0 - (x1 - x0) && p[0] <= x1 + (x1 - x0));
    if (pts.length > 1) g.append(svg("polyline", { points: pts.map((p) => `${sx(p[0])},${sy(p[1])}`).join(" "), fill: "none", stroke: s.color, "stroke-width": 1.6 }));
    if (pts.length < 60) for (const p of pts) g.append(svg("circle", { cx: sx(p[0]), cy: sy(p[1]), r: 2.2, fill: s.color }));
  }
  root.append(g);
  const cursor = svg("line", { y1: T, y2: H - B, stroke: "#9aa0a8", "stroke-dasharray": "3 3", visibility: "hidden" });
  const brush = svg("rect", { y: T, height: H - T - B, fill: "rgba(47,111,223,.15)", visibility: "hidden" });
  root.append(cursor, brush);
  const tip = document.getElementById("tooltip");
  const toX = (ev) => { const r = root.getBoundingClientRect(); return x0 + ((((ev.clientX - r.left) / r.width) * W - L) / (W - L - R)) * (x1 - x0); };
  let dragFrom = null;
  root.addEventListener("mousemove", (ev) => {
    const x = toX(ev);
    const steps = [...new Set(all.map((p) => p[0]))];
    const near = steps.reduce((a, b) => (Math.abs(b - x) < Math.abs(a - x) ? b : a), steps[0]);
    cursor.setAttribute("x1", sx(near)); cursor.setAttribute("x2", sx(near)); cursor.setAttribute("visibility", "visible");
    const lines = data.map((s) => { const p = s.points.find((q) => q[0] === near); return p ? `${s.name}: ${fmt(p[1], 4)}` : null; }).filter(Boolean);
    tip.textContent = `step ${near}\n` + lines.join("\n");
    tip.hidden = false; tip.style.left = ev.clientX + 12 + "px"; tip.style.top = ev.clientY + 12 + "px";
    if (dragFrom !== null) { const a = sx(Math.min(dragFrom, x)), b = sx(Math.max(dragFrom, x)); brush.setAttribute("x", a); brush.setAttribute("width", Math.max(0, b - a)); brush.setAttribute("visibility", "visible"); }
  });
  root.addEventListener("mouseleave", () => { cursor.setAttribute("visibility", "hidden"); tip.hidden = true; });
  root.addEventListener("mousedown", (ev) => { dragFrom = toX(ev); ev.preventDefault(); });
  root.addEventListener("mouseup", (ev) => {
    const x = toX(ev);
    if (dragFrom !== null && Math.abs(sx(x) - sx(dragFrom)) > 6) { state.zoom[title] = [Math.min(dragFrom, x), Math.max(dragFrom, x)]; box.replaceWith(chart(title, data)); tip.hidden = true; }
    dragFrom = null; brush.setAttribute("visibility", "hidden");
  });
  root.addEventListener("dblclick", () => { delete state.zoom[title]; box.replaceWith(chart(title, data)); });
  box.append(root);
  return box;
}

// -- page: one step's groups -------------------------------------------------------------------
async function pageStep(route) {
  const offset = +(route.q.get("offset") || 0);
  const [runs, step] = await Promise.all([api("runs"), api(`runs/${enc(route.run)}/step/${enc(route.split)}/${enc(route.file)}?offset=${offset}&limit=${GROUPS_PER_PAGE}`)]);
  const run = runs.find((r) => r.id === route.run) || { name: route.run, project: "" };
  crumbs([["runs", "#/"], [`${run.project}/${run.name}`, link.run(route.run) + `?split=${enc(route.split)}`], [`${route.split} step ${step.step}`, null]]);
  document.title = `${route.split} step ${step.step} · ${run.name}`;
  const groupSort = state.sort.groups || "index";
  const groups = [...step.groups].sort((a, b) => (groupSort === "mean" ? b.reward_mean - a.reward_mean : groupSort === "std" ? b.reward_std - a.reward_std : a.index - b.index));
  const cards = groups.map((g) => groupCard(route, g));
  const here = link.step(route.run, route.split, route.file);
  const pager = h("div", { class: "pager" },
    h("button", { disabled: offset <= 0, onclick: () => (location.hash = here + `?offset=${Math.max(0, offset - GROUPS_PER_PAGE)}`) }, "‹ previous"),
    h("span", { class: "muted" }, `groups ${step.total_groups ? offset + 1 : 0}–${offset + step.groups.length} of ${step.total_groups}`),
    h("button", { disabled: offset + GROUPS_PER_PAGE >= step.total_groups, onclick: () => (location.hash = here + `?offset=${offset + GROUPS_PER_PAGE}`) }, "next ›"));
  const sorter = h("select", { onchange: (e) => { state.sort.groups = e.target.value; render(true); } },
    [["index", "in file order"], ["mean", "by mean reward"], ["std", "by reward spread"]].map(([v, t]) => h("option", { value: v, selected: v === groupSort }, t)));
  const m = step.metrics || {};
  return h("div", {},
    h("h1", {}, `${route.split} step ${step.step} `, step.status !== "committed" ? h("span", { class: "badge live" }, step.status) : null),
    h("div", { class: "row" }, ...Object.entries(m).filter(([k, v]) => typeof v === "number" && /reward|loss|kl|groups|seconds/.test(k)).slice(0, 10).map(([k, v]) => h("span", { class: "badge" }, `${k} ${fmt(v)}`))),
    h("div", { class: "pager" }, "groups ", sorter), pager, ...cards, step.total_groups > GROUPS_PER_PAGE ? pager.cloneNode(true) : null);
}

function groupCard(route, g) {
  const key = "g";
  const [col, dir] = state.sort[key] || ["reward", -1];
  const ts = [...g.trajectories].sort((a, b) => dir * (a[col] - b[col]) || a.index - b.index);
  const sortTh = (label, c) => h("th", { class: "num sortable", onclick: () => { state.sort[key] = [c, col === c ? -dir : -1]; render(true); } }, label + (col === c ? (dir < 0 ? " ▼" : " ▲") : ""));
  const best = g.trajectories.reduce((a, b) => (b.reward > a.reward ? b : a), g.trajectories[0]);
  const worst = g.trajectories.reduce((a, b) => (b.reward < a.reward ? b : a), g.trajectories[0]);
  return h("div", { class: "card group", "data-group": g.index },
    h("div", { class: "row" }, h("b", {}, `group ${g.index}`), h("span", { class: "muted" }, g.prompt),
      h("span", { class: "badge" }, `mean ${fmt(g.reward_mean)} ± ${fmt(g.reward_std)}`),
      g.exceptions.length ? h("span", { class: "badge err" }, `${g.exceptions.length} exceptions`) : null,
      g.dropped ? h("span", { class: "badge err" }, `${g.dropped} dropped`) : null,
      g.trajectories.length > 1 ? h("a", { href: link.compare(route.run, route.split, route.file, g.index, best.index, worst.index), class: "compare-link" }, "best vs worst") : null),
    h("table", {}, h("thead", {}, h("tr", {}, h("th", { class: "num" }, "#"), sortTh("reward", "reward"), sortTh("advantage", "advantage"), h("th", { class: "num" }, "turns"), h("th", {}, "tool calls"), h("th", {}, "last answer"))),
      h("tbody", {}, ts.map((t) => h("tr", { class: "click traj-row", onclick: () => (location.hash = link.traj(route.run, route.split, route.file, g.index, t.index)) },
        h("td", { class: "num" }, h("a", { href: link.traj(route.run, route.split, route.file, g.index, t.index) }, String(t.index))),
        h("td", { class: "num" }, fmt(t.reward)), h("td", { class: "num" }, signed(t.advantage)), h("td", { class: "num" }, String(t.turns)),
        h("td", {}, t.tool_calls.join(", "), t.tool_errors ? h("span", { class: "badge err" }, ` ${t.tool_errors} tool errors`) : null, t.error ? h("span", { class: "badge err" }, t.error) : null),
        h("td", { class: "muted" }, t.preview))))),
    g.exceptions.map((e) => h("pre", { class: "block neg" }, `${e.type}: ${e.message}`)));
}

// -- page: one trajectory --------------------------------------------------------------------------
async function pageTraj(route) {
  const [runs, t] = await Promise.all([api("runs"), api(`runs/${enc(route.run)}/trajectory/${enc(route.split)}/${enc(route.file)}/${route.group}/${route.index}`)]);
  const run = runs.find((r) => r.id === route.run) || { name: route.run, project: "" };
  crumbs([["runs", "#/"], [`${run.project}/${run.name}`, link.run(route.run) + `?split=${enc(route.split)}`], [`${route.split} step ${t.step}`, link.step(route.run, route.split, route.file)], [`group ${t.group} · #${t.index}`, null]]);
  document.title = `trajectory ${t.group}/${t.index} · step ${t.step}`;
  const tab = route.q.get("view") || "conversation";
  const here = link.traj(route.run, route.split, route.file, t.group, t.index);
  const tabs = h("div", { class: "tabs" }, [["conversation", "Conversation"], ["tokens", "Tokens"]].map(([v, label]) => h("button", { class: v === tab ? "on" : "", id: "tab-" + v, onclick: () => (location.hash = here + `?view=${v}`) }, label)));
  const nav = h("div", { class: "pager" },
    h("button", { disabled: t.index <= 0, onclick: () => (location.hash = link.traj(route.run, route.split, route.file, t.group, t.index - 1) + `?view=${tab}`) }, "‹ previous in group"),
    h("button", { disabled: t.index >= t.group_size - 1, onclick: () => (location.hash = link.traj(route.run, route.split, route.file, t.group, t.index + 1) + `?view=${tab}`) }, "next in group ›"),
    t.group_size > 1 ? h("a", { href: link.compare(route.run, route.split, route.file, t.group) }, "group: best vs worst") : null);
  return h("div", {},
    h("h1", {}, `Trajectory ${t.index} of group ${t.group}`, " ", h("span", { class: "muted" }, `${route.split} step ${t.step}`)), nav,
    h("div", { class: "split" }, infoPanel(t), h("div", {}, tabs, tab === "tokens" ? tokenView(t) : conversation(t))));
}

function infoPanel(t) {
  const kv = (pairs) => h("dl", { class: "kv" }, pairs.flatMap(([k, v]) => [h("dt", {}, k), h("dd", {}, v)]));
  const steps = [...new Set(t.messages.filter((m) => m.policy_step !== null).map((m) => m.policy_step))];
  return h("div", {},
    h("div", { class: "card" }, kv([
      ["reward", h("b", { id: "reward" }, fmt(t.reward, 4))], ["advantage", signed(t.advantage)], ["group size", String(t.group_size)],
      ["sampled by", steps.length ? "policy step " + steps.join(", ") + (t.split === "train" ? ` (stale by ${Math.max(...steps.map((s) => t.step - s))})` : "") : "–"],
      ["tokens", `${t.trained_tokens} trained · ${t.masked_tokens} masked`],
      ["tools", t.tools.join(", ") || "–"]])),
    t.ruler_explanation ? h("div", { class: "card" }, h("b", {}, "RULER "), h("span", { class: "ruler" }, t.ruler_explanation)) : null,
    t.error ? h("div", { class: "card" }, h("b", { class: "neg" }, `${t.error.type}: `), t.error.message, h("details", {}, h("summary", {}, "traceback"), h("pre", { class: "block" }, t.error.traceback || ""))) : null,
    Object.keys(t.metrics).length ? h("div", { class: "card" }, h("b", {}, "metrics"), kv(Object.entries(t.metrics).map(([k, v]) => [k, fmt(v)]))) : null,
    Object.keys(t.metadata).length ? h("div", { class: "card" }, h("b", {}, "metadata"), h("pre", { class: "block" }, JSON.stringify(t.metadata, null, 1))) : null,
    t.logs.length ? h("div", { class: "card" }, h("b", {}, "logs"), h("pre", { class: "block" }, t.logs.join("\n"))) : null);
}

function conversation(t) {
  return h("div", { class: "conversation" }, t.messages.map((m) => {
    const kind = m.role + (m.error ? " error" : "");
    const who = h("div", { class: "who" }, h("span", {}, m.role), m.tool_call_id ? h("span", {}, "→ " + m.tool_call_id) : null,
      m.sampled ? h("span", { class: "muted" }, `sampled · ${m.tokens} tokens · mean logprob ${fmt(m.mean_logprob)} · ${m.finish_reason}`) : null,
      m.error ? h("span", { class: "neg" }, "error") : null);
    return h("div", { class: "msg " + kind }, who, m.content ? h("pre", {}, m.content) : null,
      m.tool_calls.map((c) => h("div", { class: "toolcall" }, h("span", { class: "fn" }, c.name), h("pre", { class: "args" }, prettyArgs(c.arguments)), c.id ? h("div", { class: "muted" }, c.id) : null)));
  }));
}
function prettyArgs(s) { try { return JSON.stringify(JSON.parse(s), null, 1); } catch { return s; } }

// Tokens as the trainer sees them: masked (prompt, tool results) in grey, trained (sampled) coloured
// by the sampling logprob, red (unlikely) to green (likely).
function tokenView(t) {
  if (!t.rows.length) return h("p", { class: "muted" }, "No token records: this trajectory was not sampled through a Journeyman endpoint.");
  const color = (lp) => `hsl(${Math.round(120 * Math.exp(Math.max(lp, -20)))}, 70%, 80%)`;
  return h("div", {},
    h("div", { class: "row muted" }, h("span", {}, h("span", { class: "badge" }, "masked"), " prompt and tool results (not trained)"),
      h("span", {}, "trained: p = exp(logprob) ", h("span", { class: "scale" }), " 0 → 1"),
      t.rows.some((r) => r.teacher_logprobs) ? h("span", {}, "underline: teacher − student logprob, blue > 0, orange < 0 (hover for both)") : null),
    t.rows.map((r, ri) => h("div", {}, t.rows.length > 1 ? h("h2", {}, `row ${ri + 1}`) : null,
      h("div", { class: "tokens", id: "tokens-" + ri }, r.ids.map((id, i) => {
        const text = r.text ? r.text[i] : `[${id}]`;
        const lp = r.logprobs[i];
        const tlp = r.teacher_logprobs ? r.teacher_logprobs[i] : null;
        // distillation: the teacher's logprob beside the student's, and the token's advantage from it
        // (teacher - student) as the underline, blue where the teacher liked it more, orange less
        const teacher = tlp !== null && lp !== null ? `\nteacher logprob ${fmt(tlp, 4)}\nteacher - student ${fmt(tlp - lp, 3)}` : "";
        const title = `id ${id}` + (r.trained[i] ? `\nlogprob ${fmt(lp, 4)}\np ${fmt(Math.exp(lp), 3)}${teacher}` : "\nmasked");
        const under = teacher ? `;border-bottom:3px solid ${tlp - lp >= 0 ? "#2563eb" : "#ea580c"}` : "";
        return h("span", { class: r.trained[i] ? "trained" : "masked", title, "data-teacher": tlp === null ? null : tlp, style: r.trained[i] && lp !== null ? `background:${color(lp)}${under}` : null }, text);
      })))));
}

// -- page: two trajectories of a group side by side ------------------------------------------------
async function pageCompare(route) {
  const step = await api(`runs/${enc(route.run)}/step/${enc(route.split)}/${enc(route.file)}?offset=${route.group}&limit=1`);
  const g = step.groups[0];
  if (!g) throw new Error("no such group");
  const byReward = [...g.trajectories].sort((a, b) => b.reward - a.reward);
  const a = route.q.has("a") ? +route.q.get("a") : byReward[0].index;
  const b = route.q.has("b") ? +route.q.get("b") : byReward[byReward.length - 1].index;
  const path = (i) => `runs/${enc(route.run)}/trajectory/${enc(route.split)}/${enc(route.file)}/${route.group}/${i}`;
  const [runs, ta, tb] = await Promise.all([api("runs"), api(path(a)), api(path(b))]);
  const run = runs.find((r) => r.id === route.run) || { name: route.run, project: "" };
  crumbs([["runs", "#/"], [`${run.project}/${run.name}`, link.run(route.run)], [`${route.split} step ${step.step}`, link.step(route.run, route.split, route.file)], [`group ${g.index}: compare`, null]]);
  const pick = (side, cur) => h("select", { onchange: (e) => (location.hash = link.compare(route.run, route.split, route.file, g.index, side === "a" ? +e.target.value : a, side === "b" ? +e.target.value : b)) },
    g.trajectories.map((t) => h("option", { value: t.index, selected: t.index === cur }, `#${t.index} reward ${fmt(t.reward)}`)));
  const column = (t, side) => h("div", { class: "side", "data-side": side },
    h("div", { class: "row" }, pick(side, t.index), h("b", {}, `reward ${fmt(t.reward, 4)}`), h("span", {}, "advantage ", signed(t.advantage)), h("a", { href: link.traj(route.run, route.split, route.file, g.index, t.index) }, "open")),
    t.ruler_explanation ? h("div", { class: "card" }, h("b", {}, "RULER "), t.ruler_explanation) : null, conversation(t));
  return h("div", {}, h("h1", {}, `Group ${g.index}: best vs worst`, " ", h("span", { class: "muted" }, g.prompt)), h("div", { class: "compare" }, column(ta, "a"), column(tb, "b")));
}

window.addEventListener("hashchange", () => { state.version = null; render(false); });
render(false);
state.poll = setInterval(poll, POLL_MS);
