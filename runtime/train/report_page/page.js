"use strict";
// The report page: everything drawn from the JSON in #report-data, no network.
(function () {
  const D = JSON.parse(document.getElementById("report-data").textContent);
  const SVG = "http://www.w3.org/2000/svg";
  const PALETTE = ["#1c7ed6", "#e8590c", "#2f9e44", "#ae3ec9", "#1098ad", "#f59f00", "#e03131", "#495057", "#5c7cfa", "#94d82d"];
  const state = { step: null, sortColumn: null, sortDir: 1 };
  const listeners = [];

  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }
  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }
  function finite(v) { return typeof v === "number" && isFinite(v); }
  function fmt(v, digits) {
    if (v === null || v === undefined) return "";
    if (typeof v !== "number") return String(v);
    if (Number.isInteger(v)) return String(v);
    const a = Math.abs(v);
    if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(2);
    return v.toFixed(digits === undefined ? (a < 1 ? 4 : a < 100 ? 3 : 1) : digits);
  }
  function seconds(v) {
    if (!finite(v)) return "";
    return v < 1 ? (v * 1000).toFixed(v < 0.01 ? 2 : 1) + " ms" : v.toFixed(2) + " s";
  }
  function tickFormat(ticks) {
    const step = ticks.length > 1 ? Math.abs(ticks[1] - ticks[0]) : 1;
    const digits = Math.max(0, Math.min(6, -Math.floor(Math.log10(step) + 1e-9)));
    return (v) => (Math.abs(v) >= 1e5 ? v.toExponential(1) : v.toFixed(digits));
  }
  function niceTicks(lo, hi, count) {
    if (lo === hi) { lo -= 1; hi += 1; }
    const raw = (hi - lo) / count;
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
    const ticks = [];
    for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push(+t.toPrecision(12));
    return ticks;
  }

  // A line chart: x values, one or more series, hover for values, click to pick an x.
  function chart(host, opts) {
    const card = el("div", { class: "card" });
    card.appendChild(el("h3", {}, opts.title));
    if (opts.subtitle) card.appendChild(el("div", { class: "muted" }, opts.subtitle));
    host.appendChild(card);
    const W = 560, H = 220, L = 54, R = 12, T = 10, B = 34;
    const root = svg("svg", { class: "chart", viewBox: `0 0 ${W} ${H}`, role: "img", "data-title": opts.title });
    card.appendChild(root);
    const xs = opts.x;
    const ys = [];
    opts.series.forEach((s) => s.y.forEach((v) => { if (finite(v)) ys.push(v); }));
    const xv = xs.filter(finite);
    if (!ys.length || !xv.length) {
      root.appendChild(svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle" }, "no data yet"));
      return;
    }
    let x0 = Math.min(...xv), x1 = Math.max(...xv);
    if (x0 === x1) { x0 -= 1; x1 += 1; }
    let y0 = Math.min(...ys), y1 = Math.max(...ys);
    if (opts.yFrom0 && y0 > 0) y0 = 0;
    if (y0 === y1) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
    const pad = (y1 - y0) * 0.05; y0 -= opts.yFrom0 && y0 === 0 ? 0 : pad; y1 += pad;
    const px = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
    const py = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
    const yTicks = niceTicks(y0, y1, 4), xTicks = niceTicks(x0, x1, 6);
    const yLabel = opts.tickFormat || tickFormat(yTicks), xLabel = tickFormat(xTicks);
    for (const t of yTicks) {
      if (t < y0 || t > y1) continue;
      root.appendChild(svg("line", { class: "gridline", x1: L, x2: W - R, y1: py(t), y2: py(t) }));
      root.appendChild(svg("text", { x: L - 6, y: py(t) + 4, "text-anchor": "end" }, yLabel(t)));
    }
    for (const t of xTicks) {
      if (t < x0 || t > x1) continue;
      root.appendChild(svg("text", { x: px(t), y: H - B + 15, "text-anchor": "middle" }, xLabel(t)));
    }
    root.appendChild(svg("line", { class: "axis", x1: L, x2: L, y1: T, y2: H - B }));
    root.appendChild(svg("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }));
    root.appendChild(svg("text", { x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle" }, opts.xlabel || "step"));
    for (const m of opts.marks || []) {
      if (finite(m)) root.appendChild(svg("circle", { class: "mark", cx: px(m), cy: H - B, r: 2.2 }));
    }
    function pathOf(y) {
      let d = "", pen = false;
      for (let i = 0; i < xs.length; i++) {
        if (!finite(y[i]) || !finite(xs[i])) { pen = false; continue; }
        d += (pen ? "L" : "M") + px(xs[i]).toFixed(1) + " " + py(y[i]).toFixed(1);
        pen = true;
      }
      return d;
    }
    opts.series.forEach((s, i) => {
      const color = s.color || PALETTE[i % PALETTE.length];
      if (opts.smooth && s.y.length >= 2 * opts.smooth) {
        root.appendChild(svg("path", { class: "raw", d: pathOf(s.y) }));
        const w = opts.smooth, avg = [];
        for (let j = 0; j < s.y.length; j++) {
          const win = s.y.slice(Math.max(0, j - w + 1), j + 1).filter(finite);
          avg.push(j >= w - 1 && win.length ? win.reduce((a, b) => a + b, 0) / win.length : null);
        }
        root.appendChild(svg("path", { class: "line", stroke: color, d: pathOf(avg), "data-points": s.y.filter(finite).length }));
      } else {
        root.appendChild(svg("path", { class: "line", stroke: color, d: pathOf(s.y), "data-points": s.y.filter(finite).length }));
      }
    });
    if (opts.series.length > 1 || opts.smooth) {
      const legend = el("div", { class: "legend" });
      opts.series.forEach((s, i) => {
        const item = el("span");
        const swatch = el("i");
        swatch.style.background = s.color || PALETTE[i % PALETTE.length];
        item.appendChild(swatch);
        item.appendChild(document.createTextNode(s.name + (opts.smooth ? ` (mean of ${opts.smooth}; grey: each step)` : "")));
        legend.appendChild(item);
      });
      card.appendChild(legend);
    }
    const cursor = svg("line", { class: "cursor", y1: T, y2: H - B, visibility: "hidden" });
    const selected = svg("line", { class: "selected", y1: T, y2: H - B, visibility: "hidden" });
    const tip = svg("text", { x: L + 6, y: T + 12, visibility: "hidden" });
    root.appendChild(selected);
    root.appendChild(cursor);
    root.appendChild(tip);
    const hit = svg("rect", { x: L, y: T, width: W - L - R, height: H - T - B, fill: "transparent" });
    root.appendChild(hit);
    function nearest(evt) {
      const box = root.getBoundingClientRect();
      const x = ((evt.clientX - box.left) / box.width) * W;
      const target = x0 + ((x - L) / (W - L - R)) * (x1 - x0);
      let best = -1, dist = Infinity;
      xs.forEach((v, i) => { if (finite(v) && Math.abs(v - target) < dist) { dist = Math.abs(v - target); best = i; } });
      return best;
    }
    hit.addEventListener("mousemove", (evt) => {
      const i = nearest(evt);
      if (i < 0) return;
      cursor.setAttribute("x1", px(xs[i])); cursor.setAttribute("x2", px(xs[i]));
      cursor.setAttribute("visibility", "visible");
      const parts = opts.series.map((s) => (opts.series.length > 1 ? s.name + " " : "") + (opts.format || fmt)(s.y[i]));
      tip.textContent = `${opts.xlabel || "step"} ${fmt(xs[i])}: ${parts.join(", ")}`;
      tip.setAttribute("visibility", "visible");
    });
    hit.addEventListener("mouseleave", () => { cursor.setAttribute("visibility", "hidden"); tip.setAttribute("visibility", "hidden"); });
    if (opts.onPick) {
      hit.style.cursor = "pointer";
      hit.addEventListener("click", (evt) => { const i = nearest(evt); if (i >= 0) opts.onPick(xs[i]); });
      listeners.push((step) => {
        if (step === null || !finite(step)) { selected.setAttribute("visibility", "hidden"); return; }
        selected.setAttribute("x1", px(step)); selected.setAttribute("x2", px(step));
        selected.setAttribute("visibility", "visible");
      });
    }
  }

  // Header
  document.getElementById("title").textContent = D.title + ": run report";
  document.getElementById("status").textContent = D.status;
  document.getElementById("where").textContent = `${D.run} · written ${D.written}` +
    (D.summary && D.summary.reward_first !== null && D.summary.reward_first !== undefined
      ? ` · mean reward first ${D.summary.window} steps ${fmt(D.summary.reward_first, 3)} → last ${D.summary.window} steps ${fmt(D.summary.reward_last, 3)}`
      : "");
  const notes = document.getElementById("notes");
  for (const n of D.notes) notes.appendChild(el("li", {}, n));

  // Samples: columns and which steps have them
  const S = D.samples;
  const col = (name) => S.columns.indexOf(name);
  const C = { step: col("step"), sample: col("sample"), prompt: col("prompt"), response: col("response"),
    reward: col("reward"), length: col("length"), stop: col("stop_reason"),
    image: S.columns.indexOf("image") >= 0 ? col("image") : col("thumbnail") };
  const sampleSteps = C.step >= 0 ? [...new Set(S.rows.map((r) => r[C.step]))].filter(finite).sort((a, b) => a - b) : [];
  function sampleStepNear(step) {
    if (!sampleSteps.length) return null;
    return sampleSteps.reduce((best, s) => (Math.abs(s - step) < Math.abs(best - step) ? s : best), sampleSteps[0]);
  }
  function pick(step) {
    const s = sampleStepNear(step);
    state.step = s;
    document.getElementById("f-step").value = s === null ? "" : String(s);
    document.getElementById("bw-step").value = s === null ? "" : String(s);
    renderSamples();
    renderBestWorst();
    listeners.forEach((f) => f(s));
  }

  // Curves
  const grid = document.getElementById("curve-grid");
  const M = D.metrics;
  if (!M.curves.length) grid.appendChild(el("p", { class: "muted" }, "no curves: metrics.jsonl has no rows with reward, KL, length or throughput"));
  for (const c of M.curves) {
    chart(grid, { title: c.title, subtitle: c.key, x: M.steps, series: [{ name: c.key, y: c.y }],
      smooth: c.id === "reward" && M.steps.length >= 20 ? 5 : 0, marks: sampleSteps, onPick: pick,
      yFrom0: c.id === "throughput" || c.id === "length" });
  }

  // Time: per node per step, controllers over the run, the node table
  const N = D.nodes;
  chart(document.getElementById("node-chart"), { title: "time per node per step", subtitle: `from ${N.source}`,
    x: N.steps, series: N.series, format: seconds, tickFormat: seconds, yFrom0: true, onPick: pick });
  const U = D.utilization;
  const percent = (v) => (finite(v) ? (100 * v).toFixed(0) + "%" : "");
  chart(document.getElementById("util-chart"), { title: "controller utilization (busy share)",
    subtitle: U.xlabel === "step" ? "from metrics.jsonl util/*" : "from trace.json: the union of each controller's spans",
    x: U.x, xlabel: U.xlabel, series: U.series, format: percent, tickFormat: percent, yFrom0: true });
  const nodeTable = document.getElementById("node-table");
  const head = el("tr");
  ["node", "controllers", "steps", "mean a step", "total", "share of node time", ""].forEach((h) => head.appendChild(el("th", {}, h)));
  nodeTable.appendChild(el("thead")).appendChild(head);
  const nodeBody = nodeTable.appendChild(el("tbody"));
  for (const t of N.table) {
    const tr = el("tr");
    tr.appendChild(el("td", {}, t.name));
    tr.appendChild(el("td", {}, t.controllers.join(", ")));
    tr.appendChild(el("td", { class: "n" }, t.steps));
    tr.appendChild(el("td", { class: "n" }, seconds(t.mean_s)));
    tr.appendChild(el("td", { class: "n" }, seconds(t.total_s)));
    tr.appendChild(el("td", { class: "n" }, (100 * t.share).toFixed(1) + "%"));
    const bar = el("td");
    const b = el("span", { class: "bar" });
    b.style.width = Math.max(1, Math.round(200 * t.share)) + "px";
    bar.appendChild(b);
    tr.appendChild(bar);
    nodeBody.appendChild(tr);
  }

  // Graph
  (function drawGraph() {
    const box = document.getElementById("graph-box");
    const G = D.graph;
    if (!G || !G.nodes.length) { box.appendChild(el("p", { class: "muted" }, "no graph: the run recorded none and traced no node")); return; }
    const unit = 44, bw = 150, bh = 50, margin = 30;
    const xsG = G.nodes.map((n) => n.x * unit), ysG = G.nodes.map((n) => -n.y * unit);
    const minX = Math.min(...xsG), minY = Math.min(...ysG);
    const hasDelay = G.edges.some((e) => e.delay);
    const W = Math.max(...xsG) - minX + bw + 2 * margin, H = Math.max(...ysG) - minY + bh + 2 * margin + (hasDelay ? 40 : 0);
    const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H, id: "graph-svg" });
    const defs = svg("defs");
    const marker = svg("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse" });
    marker.appendChild(svg("path", { d: "M0 0 L10 5 L0 10 z", fill: "#868e96" }));
    defs.appendChild(marker);
    root.appendChild(defs);
    const at = {};
    G.nodes.forEach((n, i) => { at[n.name] = { x: xsG[i] - minX + margin, y: ysG[i] - minY + margin }; });
    const bottom = H - 14;
    for (const e of G.edges) {
      const a = at[e.src], b = at[e.dst];
      if (!a || !b) continue;
      const title = svg("title", {}, `${e.src} → ${e.dst}: ${e.ports.join(", ")}${e.delay ? " (next step)" : ""}`);
      let path;
      if (e.delay) {
        const x1 = a.x + bw / 2, x2 = b.x + bw / 2;
        path = svg("path", { d: `M${x1} ${a.y + bh} C${x1} ${bottom}, ${x2} ${bottom}, ${x2} ${b.y + bh}`, fill: "none",
          stroke: "#868e96", "stroke-dasharray": "5 4", "marker-end": "url(#arrow)" });
      } else {
        const x1 = a.x + bw, y1 = a.y + bh / 2, x2 = b.x, y2 = b.y + bh / 2, mid = (x1 + x2) / 2;
        path = svg("path", { d: `M${x1} ${y1} C${mid} ${y1}, ${mid} ${y2}, ${x2} ${y2}`, fill: "none", stroke: "#868e96", "marker-end": "url(#arrow)" });
      }
      path.appendChild(title);
      root.appendChild(path);
    }
    for (const n of G.nodes) {
      const p = at[n.name];
      const g = svg("g", { class: "graph-node", "data-node": n.name });
      g.appendChild(svg("title", {}, `${n.name} (${n.kind || "node"})` + (n.controllers.length ? `, controller ${n.controllers.join(", ")}` : "")));
      g.appendChild(svg("rect", { x: p.x, y: p.y, width: bw, height: bh, rx: 7, fill: n.color, stroke: "#495057" }));
      if (finite(n.share)) {
        g.appendChild(svg("rect", { x: p.x + 6, y: p.y + bh - 9, width: Math.max(1, (bw - 12) * n.share), height: 4, fill: "#1c7ed6" }));
      }
      g.appendChild(svg("text", { x: p.x + bw / 2, y: p.y + 18, "text-anchor": "middle", "font-weight": "bold" }, n.name));
      const info = finite(n.mean_s) ? `${seconds(n.mean_s)} · ${(100 * n.share).toFixed(1)}%` : "not traced";
      g.appendChild(svg("text", { x: p.x + bw / 2, y: p.y + 34, "text-anchor": "middle" }, info));
      root.appendChild(g);
    }
    box.appendChild(root);
  })();

  // Sample browser
  const stepSelect = document.getElementById("f-step");
  const bwSelect = document.getElementById("bw-step");
  stepSelect.appendChild(el("option", { value: "" }, `all (${sampleSteps.length} steps)`));
  for (const s of sampleSteps) {
    stepSelect.appendChild(el("option", { value: String(s) }, s));
    bwSelect.appendChild(el("option", { value: String(s) }, s));
  }
  if (C.stop >= 0) {
    const stops = [...new Set(S.rows.map((r) => r[C.stop]))].sort();
    const stopSelect = document.getElementById("f-stop");
    stopSelect.appendChild(el("option", { value: "" }, "any"));
    for (const s of stops) stopSelect.appendChild(el("option", { value: String(s) }, s));
    document.getElementById("f-stop-label").hidden = false;
  }
  const SHOWN = ["step", "sample", "prompt", "response", "reward", "length", "stop_reason"].filter((c) => col(c) >= 0);
  const extra = S.columns.filter((c) => !SHOWN.includes(c) && c !== "prompt_index" && col(c) !== C.image);
  const columns = (C.image >= 0 ? [S.columns[C.image]] : []).concat(SHOWN, extra);
  const MAX_ROWS = 2000;

  function cellOf(row, name) {
    const i = col(name), v = row[i];
    if (i === C.image) {
      const td = el("td");
      const src = typeof v === "string" && S.images && S.images[v] ? S.images[v] : v;
      if (typeof src === "string" && src.startsWith("data:image/")) td.appendChild(el("img", { src: src, alt: "image", title: src === v ? "" : v }));
      return td;
    }
    if (typeof v === "number") return el("td", { class: "n" }, fmt(v));
    return el("td", { class: name === "prompt" || name === "response" ? "text" : "" }, v);
  }
  function number(id) {
    const v = document.getElementById(id).value;
    return v === "" ? null : Number(v);
  }
  function filtered() {
    const step = stepSelect.value === "" ? null : Number(stepSelect.value);
    const rmin = number("f-reward-min"), rmax = number("f-reward-max");
    const lmin = number("f-length-min"), lmax = number("f-length-max");
    const stop = C.stop >= 0 ? document.getElementById("f-stop").value : "";
    const text = document.getElementById("f-text").value.toLowerCase();
    return S.rows.filter((r) => {
      if (step !== null && r[C.step] !== step) return false;
      if (C.reward >= 0 && (rmin !== null || rmax !== null)) {
        const v = r[C.reward];
        if (!finite(v) || (rmin !== null && v < rmin) || (rmax !== null && v > rmax)) return false;
      }
      if (C.length >= 0 && (lmin !== null || lmax !== null)) {
        const v = r[C.length];
        if (!finite(v) || (lmin !== null && v < lmin) || (lmax !== null && v > lmax)) return false;
      }
      if (stop !== "" && String(r[C.stop]) !== stop) return false;
      if (text && !((C.prompt >= 0 && String(r[C.prompt]).toLowerCase().includes(text)) ||
        (C.response >= 0 && String(r[C.response]).toLowerCase().includes(text)))) return false;
      return true;
    });
  }
  function compare(a, b) {
    if (a === b) return 0;
    if (a === null || a === undefined) return 1;
    if (b === null || b === undefined) return -1;
    if (typeof a === "number" && typeof b === "number") return a - b;
    return String(a).localeCompare(String(b));
  }
  const table = document.getElementById("sample-table");
  const headRow = el("tr");
  for (const name of columns) {
    const th = el("th", { "data-column": name }, name === S.columns[C.image] ? "image" : name);
    if (name !== S.columns[C.image]) {
      th.addEventListener("click", () => {
        state.sortDir = state.sortColumn === name ? -state.sortDir : name === "reward" || name === "length" ? -1 : 1;
        state.sortColumn = name;
        renderSamples();
      });
    }
    headRow.appendChild(th);
  }
  table.tHead.appendChild(headRow);
  function renderSamples() {
    let rows = filtered();
    if (state.sortColumn) {
      const i = col(state.sortColumn), dir = state.sortDir;
      rows = rows.slice().sort((a, b) => {
        const c = compare(a[i], b[i]);
        return a[i] === null || b[i] === null ? c : dir * c;
      });
    }
    for (const th of headRow.children) {
      th.removeAttribute("data-sort");
      if (th.dataset.column === state.sortColumn) th.setAttribute("data-sort", state.sortDir > 0 ? "asc" : "desc");
    }
    const body = table.tBodies[0];
    body.replaceChildren();
    for (const r of rows.slice(0, MAX_ROWS)) {
      const tr = el("tr");
      for (const name of columns) tr.appendChild(cellOf(r, name));
      body.appendChild(tr);
    }
    const count = document.getElementById("sample-count");
    count.textContent = `${rows.length} of ${S.rows.length} samples`;
    count.dataset.count = String(rows.length);
    document.getElementById("sample-cap").textContent = rows.length > MAX_ROWS ? `(the first ${MAX_ROWS} shown: filter to see the others)` : "";
  }
  for (const id of ["f-step", "f-reward-min", "f-reward-max", "f-length-min", "f-length-max", "f-stop", "f-text"]) {
    const input = document.getElementById(id);
    input.addEventListener(input.tagName === "SELECT" ? "change" : "input", () => {
      if (id === "f-step") {
        state.step = stepSelect.value === "" ? null : Number(stepSelect.value);
        listeners.forEach((f) => f(state.step));
      }
      renderSamples();
    });
  }
  document.getElementById("f-clear").addEventListener("click", () => {
    for (const id of ["f-reward-min", "f-reward-max", "f-length-min", "f-length-max", "f-text"]) document.getElementById(id).value = "";
    stepSelect.value = "";
    if (C.stop >= 0) document.getElementById("f-stop").value = "";
    state.sortColumn = null;
    listeners.forEach((f) => f(null));
    renderSamples();
  });

  // Best and worst of a step
  function sampleTable(target, rows) {
    target.replaceChildren();
    const names = columns.filter((c) => c !== "step");
    const tr = el("tr");
    names.forEach((n) => tr.appendChild(el("th", {}, n === S.columns[C.image] ? "image" : n)));
    target.appendChild(el("thead")).appendChild(tr);
    const body = target.appendChild(el("tbody"));
    for (const r of rows) {
      const row = el("tr");
      names.forEach((n) => row.appendChild(cellOf(r, n)));
      body.appendChild(row);
    }
  }
  function renderBestWorst() {
    const best = document.getElementById("best-table"), worst = document.getElementById("worst-table");
    if (!sampleSteps.length || C.reward < 0) {
      best.replaceChildren(); worst.replaceChildren();
      best.appendChild(el("caption", {}, "no samples"));
      return;
    }
    const step = Number(bwSelect.value);
    const rows = S.rows.filter((r) => r[C.step] === step && finite(r[C.reward]));
    rows.sort((a, b) => b[C.reward] - a[C.reward]);
    const k = Math.min(5, Math.ceil(rows.length / 2));
    sampleTable(best, rows.slice(0, k));
    sampleTable(worst, rows.slice(rows.length - k).reverse());
  }
  bwSelect.addEventListener("change", renderBestWorst);
  if (sampleSteps.length) bwSelect.value = String(sampleSteps[sampleSteps.length - 1]);
  renderSamples();
  renderBestWorst();

  // Settings and events
  (function renderSettings() {
    const box = document.getElementById("settings-box");
    const st = D.settings;
    if (!st) { box.appendChild(el("p", { class: "muted" }, "no settings.json in the run folder")); return; }
    const groups = [["graph config (resolved)", st.config], ["run config", st.run_config], ["graph options given", st.graph_options], ["command-line flags", st.flags]];
    const top = el("table", { class: "settings-table" });
    top.appendChild(el("tbody"));
    const add = (t, k, v) => {
      const tr = el("tr");
      tr.appendChild(el("td", {}, k));
      tr.appendChild(el("td", {}, typeof v === "object" && v !== null ? JSON.stringify(v) : v === null ? "None" : String(v)));
      t.tBodies[0].appendChild(tr);
    };
    add(top, "graph", st.graph);
    if (st.threads) add(top, "threads", st.threads);
    for (const n of st.notes || []) add(top, "note", n);
    box.appendChild(top);
    for (const [title, values] of groups) {
      if (!values || typeof values !== "object") continue;
      const details = el("details", title === "command-line flags" ? {} : { open: "" });
      details.appendChild(el("summary", {}, `${title} (${Object.keys(values).length})`));
      const t = el("table", { class: "settings-table" });
      t.appendChild(el("tbody"));
      for (const k of Object.keys(values).sort()) add(t, k, values[k]);
      details.appendChild(t);
      box.appendChild(details);
    }
    if (D.events.length) {
      const ev = document.getElementById("events-box");
      ev.appendChild(el("h3", {}, `events (${D.events.length}, events.jsonl)`));
      ev.appendChild(el("pre", {}, D.events.map((e) => JSON.stringify(e)).join("\n")));
    }
  })();
})();
