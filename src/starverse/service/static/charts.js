/* Small SVG charts for the console (no library, no CDN): line charts and a scatter plot with a frontier. */
"use strict";
const SVGNS = "http://www.w3.org/2000/svg";
const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#be185d", "#4d7c0f"];

function svgEl(tag, attrs, parent) {
  const el = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, v);
  if (parent) parent.appendChild(el);
  return el;
}

function niceTicks(lo, hi, n) {
  if (!(hi > lo)) { hi = lo + 1; }
  const step0 = (hi - lo) / Math.max(1, n);
  const mag = Math.pow(10, Math.floor(Math.log10(step0)));
  const step = [1, 2, 5, 10].map(m => m * mag).find(s => s >= step0) || step0;
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(+v.toPrecision(12));
  return out;
}

function fmt(v) {
  const a = Math.abs(v);
  if (a >= 1e6) return (v / 1e6).toPrecision(3) + "M";
  if (a >= 1e3) return (v / 1e3).toPrecision(3) + "k";
  if (a === 0) return "0";
  return a < 0.01 ? v.toExponential(1) : +v.toPrecision(3) + "";
}

/* series: [{name, points: [[x, y], ...], color?, dash?}], opts: {xLabel, yLabel, logX, height, markers} */
function plotAxes(svg, xs, ys, opts) {
  const W = 640, H = opts.height || 260, L = 56, R = 14, T = 12, B = 40;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const tx = opts.logX ? (v => Math.log10(Math.max(v, 1e-12))) : (v => v);
  let x0 = Math.min(...xs.map(tx)), x1 = Math.max(...xs.map(tx));
  let y0 = Math.min(0, ...ys), y1 = Math.max(...ys);
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) { y1 = y0 + 1; }
  y1 += (y1 - y0) * 0.05;
  const sx = v => L + (tx(v) - x0) / (x1 - x0) * (W - L - R);
  const sy = v => H - B - (v - y0) / (y1 - y0) * (H - T - B);
  svgEl("rect", {x: L, y: T, width: W - L - R, height: H - T - B, fill: "#fff", stroke: "#dfe3ea"}, svg);
  for (const v of niceTicks(y0, y1, 5)) {
    svgEl("line", {x1: L, x2: W - R, y1: sy(v), y2: sy(v), stroke: "#eef1f5"}, svg);
    svgEl("text", {x: L - 6, y: sy(v) + 4, "text-anchor": "end"}, svg).textContent = fmt(v);
  }
  const xt = opts.logX ? niceTicks(x0, x1, 5).map(v => Math.pow(10, v)) : niceTicks(x0, x1, 6);
  for (const v of xt) {
    svgEl("text", {x: sx(v), y: H - B + 16, "text-anchor": "middle"}, svg).textContent = fmt(v);
  }
  svgEl("text", {x: (L + W - R) / 2, y: H - 6, "text-anchor": "middle"}, svg).textContent = opts.xLabel || "";
  const yl = svgEl("text", {x: 12, y: (T + H - B) / 2, "text-anchor": "middle",
                            transform: `rotate(-90 12 ${(T + H - B) / 2})`}, svg);
  yl.textContent = opts.yLabel || "";
  return {sx, sy};
}

function lineChart(container, series, opts) {
  container.innerHTML = "";
  const pts = series.flatMap(s => s.points);
  if (!pts.length) { container.innerHTML = '<p class="muted">No samples yet.</p>'; return; }
  const svg = svgEl("svg", {class: "chart", role: "img", "aria-label": opts.title || opts.yLabel || "chart"});
  const {sx, sy} = plotAxes(svg, pts.map(p => p[0]), pts.map(p => p[1]), opts);
  series.forEach((s, i) => {
    const color = s.color || PALETTE[i % PALETTE.length];
    const d = s.points.map((p, j) => `${j ? "L" : "M"}${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join("");
    svgEl("path", {d, fill: "none", stroke: color, "stroke-width": 2, "stroke-dasharray": s.dash || ""}, svg);
    if (s.points.length < 40) {
      for (const p of s.points) svgEl("circle", {cx: sx(p[0]), cy: sy(p[1]), r: 2.5, fill: color}, svg);
    }
  });
  container.appendChild(svg);
  if (series.length > 1 || opts.legend) {
    const lg = document.createElement("div");
    lg.className = "legend";
    series.forEach((s, i) => {
      const span = document.createElement("span");
      span.innerHTML = `<i style="background:${s.color || PALETTE[i % PALETTE.length]}"></i>`;
      span.appendChild(document.createTextNode(s.name));
      lg.appendChild(span);
    });
    container.appendChild(lg);
  }
}

/* The plans' time/cost plot: frontier line, ranked plans as points (labelled by rank), the chosen one starred. */
function paretoChart(container, frontier, plans, opts) {
  container.innerHTML = "";
  const all = frontier.map(p => [p.hours, p.cost]).concat(plans.map(p => [p.hours, p.cost]));
  const pts = all.filter(p => isFinite(p[0]) && isFinite(p[1]) && p[0] > 0);
  if (!pts.length) { container.innerHTML = '<p class="muted">Nothing to plot.</p>'; return; }
  const xs = pts.map(p => p[0]);
  const logX = Math.max(...xs) / Math.min(...xs) > 20;
  const svg = svgEl("svg", {class: "chart", role: "img", "aria-label": "cost versus time of the plans"});
  const {sx, sy} = plotAxes(svg, xs, pts.map(p => p[1]), {...opts, logX, height: 300});
  const fr = frontier.filter(p => p.hours > 0 && isFinite(p.cost));
  if (fr.length) {
    const d = fr.map((p, j) => `${j ? "L" : "M"}${sx(p.hours).toFixed(1)},${sy(p.cost).toFixed(1)}`).join("");
    svgEl("path", {d, fill: "none", stroke: "#93c5fd", "stroke-width": 2}, svg);
    for (const p of fr) {
      const c = svgEl("circle", {cx: sx(p.hours), cy: sy(p.cost), r: 3.5, fill: "#93c5fd"}, svg);
      svgEl("title", {}, c).textContent = `${p.label}: ${fmt(p.hours)} h, ${fmt(p.cost)}`;
    }
  }
  plans.forEach((p, i) => {
    if (!(p.hours > 0) || !isFinite(p.cost)) return;
    const x = sx(p.hours), y = sy(p.cost);
    if (i === 0) {
      const star = svgEl("path", {d: starPath(x, y, 9), fill: "#dc2626"}, svg);
      svgEl("title", {}, star).textContent = `plan 1 (chosen): ${fmt(p.hours)} h, ${fmt(p.cost)}`;
    } else {
      svgEl("circle", {cx: x, cy: y, r: 5, fill: "#334155"}, svg);
    }
    svgEl("text", {x: x + 8, y: y - 6, style: "fill:#1c2330;font-weight:600"}, svg).textContent = String(i + 1);
  });
  container.appendChild(svg);
  const lg = document.createElement("div");
  lg.className = "legend";
  lg.innerHTML = '<span><i style="background:#93c5fd"></i>Pareto frontier (no plan is both faster and cheaper)</span>' +
                 '<span><i style="background:#dc2626"></i>chosen plan</span><span><i style="background:#334155"></i>other ranked plans</span>';
  container.appendChild(lg);
}

function starPath(cx, cy, r) {
  let d = "";
  for (let i = 0; i < 10; i++) {
    const a = Math.PI / 5 * i - Math.PI / 2, rr = i % 2 ? r * 0.45 : r;
    d += `${i ? "L" : "M"}${(cx + rr * Math.cos(a)).toFixed(1)},${(cy + rr * Math.sin(a)).toFixed(1)}`;
  }
  return d + "Z";
}
