/* The Starverse console: sign in with a token, plan, submit and watch jobs, checkpoints, bills. */
"use strict";
const main = document.getElementById("main");
const TOKEN_KEY = "starverse-token";
let pollTimer = null;

const DEFAULT_PLAN_JOB = `# what you want to train
model: llama-2-7b
train: {seq_len: 4096, global_batch: 128, tokens: 2.0e9}
objective: cost-performance   # cost-performance | throughput | cost | time
constraints: {max_budget_per_hour: 20}
`;
const DEFAULT_POOL = `# what can be rented (prices per device-hour)
currency: USD
offers:
  - {accelerator: rtx-4090, count: 16, price_per_hour: 0.69}
  - {accelerator: a100-80gb-sxm, count: 8, price_per_hour: 2.45}
  - {accelerator: l40s, count: 8, price_per_hour: 0.86}
cross_offer_gbps: 100
`;

function esc(s) {
  return String(s ?? "").replace(/[&<>"']/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
}
function num(v, digits) {
  if (v === null || v === undefined || !isFinite(v)) return "–";
  return Number(v).toLocaleString(undefined, {maximumFractionDigits: digits ?? 2});
}
function when(t) { return t ? new Date(t * 1000).toLocaleString() : "–"; }
function token() { return sessionStorage.getItem(TOKEN_KEY); }

class ApiError extends Error { constructor(status, detail) { super(detail); this.status = status; } }

async function api(path, opts = {}) {
  const headers = {Authorization: `Bearer ${token()}`, ...(opts.headers || {})};
  let body = opts.body;
  if (opts.json !== undefined) { body = JSON.stringify(opts.json); headers["Content-Type"] = "application/json"; }
  const r = await fetch(path, {method: opts.method || "GET", headers, body});
  const text = await r.text();
  let data = text;
  try { data = text ? JSON.parse(text) : null; } catch (e) { /* plain text (logs) */ }
  if (r.status === 401) { signOut(); throw new ApiError(401, "Your token was refused; sign in again."); }
  if (!r.ok) throw new ApiError(r.status, (data && data.detail) || r.statusText);
  return data;
}

function signOut() {
  sessionStorage.removeItem(TOKEN_KEY);
  document.getElementById("nav").hidden = true;
  location.hash = "#/signin";
}
document.getElementById("signout").addEventListener("click", signOut);

function setNav(active) {
  document.querySelectorAll("[data-nav]").forEach(a => a.classList.toggle("active", a.dataset.nav === active));
}

async function route() {
  if (pollTimer) { clearTimeout(pollTimer); pollTimer = null; }
  const hash = location.hash || "#/plan";
  if (!token()) { return renderSignIn(); }
  document.getElementById("nav").hidden = false;
  const [, page, arg] = hash.split("/");
  setNav(page === "job" ? "jobs" : page);
  try {
    if (page === "jobs") await renderJobs();
    else if (page === "job") await renderJob(arg);
    else if (page === "bill") await renderBill();
    else await renderPlan();
  } catch (e) {
    main.innerHTML = `<section class="card"><h1>${e.status === 404 ? "Not found" : "Error"}</h1>
      <p class="error" role="alert">${esc(e.message)}</p><p><a href="#/jobs">Back to your jobs</a></p></section>`;
  }
}
window.addEventListener("hashchange", route);

function renderSignIn() {
  document.getElementById("nav").hidden = true;
  main.innerHTML = "";
  main.appendChild(document.getElementById("t-signin").content.cloneNode(true));
  document.getElementById("signin-form").addEventListener("submit", async ev => {
    ev.preventDefault();
    const t = document.getElementById("token").value.trim();
    const r = await fetch("/api/whoami", {headers: {Authorization: `Bearer ${t}`}});
    if (!r.ok) { document.getElementById("signin-error").textContent = "That token was refused (wrong, expired or revoked)."; return; }
    sessionStorage.setItem(TOKEN_KEY, t);
    const who = await r.json();
    document.getElementById("who").textContent = `tenant ${who.tenant}`;
    location.hash = location.hash && location.hash !== "#/signin" ? location.hash : "#/plan";
    route();
  });
}

/* ---------- plan ---------- */
async function renderPlan() {
  main.innerHTML = `
  <section class="card"><h1>Plan a job</h1>
    <p class="muted">What to train and what can be rented: the planner ranks device mixes and parallel layouts by your objective.</p>
    <form id="plan-form"><div class="grid2">
      <div><label for="plan-job">Job</label><textarea id="plan-job" spellcheck="false">${esc(DEFAULT_PLAN_JOB)}</textarea></div>
      <div><label for="plan-pool">Pool</label><textarea id="plan-pool" spellcheck="false">${esc(DEFAULT_POOL)}</textarea></div>
    </div><button type="submit" id="plan-submit">Plan</button></form>
    <p class="error" id="plan-error" role="alert"></p>
  </section>
  <div id="plan-out"></div>`;
  document.getElementById("plan-form").addEventListener("submit", async ev => {
    ev.preventDefault();
    const btn = document.getElementById("plan-submit"), err = document.getElementById("plan-error");
    btn.disabled = true; err.textContent = ""; btn.textContent = "Planning…";
    try {
      const doc = await api("/api/plan", {method: "POST", json: {
        job_yaml: document.getElementById("plan-job").value, pool_yaml: document.getElementById("plan-pool").value, top: 6}});
      showPlans(doc);
    } catch (e) { err.textContent = e.message; }
    finally { btn.disabled = false; btn.textContent = "Plan"; }
  });
}

function showPlans(doc) {
  const out = document.getElementById("plan-out");
  if (!doc.feasible) {
    out.innerHTML = `<section class="card" id="infeasible"><h2>No plan fits</h2><p class="error">${esc(doc.message)}</p>
      ${doc.reasons.length ? `<h3>What would make it feasible</h3><ul class="notes">${doc.reasons.map(r => `<li>${esc(r)}</li>`).join("")}</ul>` : ""}</section>`;
    return;
  }
  const ccy = doc.currency, per = doc.per_job ? "" : " per 1e9 tokens";
  const rows = doc.plans.map(p => {
    const hours = p.hours ?? (1e9 / p.effective_tokens_per_s / 3600);
    const total = p.total_cost ?? hours * p.cost_per_hour;
    return {...p, hours, cost: total};
  });
  out.innerHTML = `
  <section class="card"><h2>Ranked plans — ${esc(doc.model)}, objective ${esc(doc.objective)}</h2>
    <p id="plan-chosen"><strong>Chosen: plan 1</strong>, ${esc(doc.chosen)}.</p>
    ${doc.notes.length ? `<ul class="notes muted">${doc.notes.map(n => `<li>${esc(n)}</li>`).join("")}</ul>` : ""}
    <div class="scroll"><table id="plans-table" class="collapse-sm"><thead><tr><th>#</th><th>devices</th><th class="hide-sm">layout</th>
      <th class="num">tokens/s</th><th class="num hide-sm">MFU</th><th class="num">${esc(ccy)}/h</th><th class="num">total${per}</th>
      <th class="num">hours${per}</th><th class="hide-sm">bottleneck</th></tr></thead><tbody>
      ${rows.map((p, i) => `<tr class="${i === 0 ? "best" : ""}"><td>${i + 1}${p.alternative ? " <span class='badge'>" + esc(p.mode) + " alt.</span>" : ""}</td>
        <td>${Object.entries(p.devices).map(([k, n]) => `${n}× ${esc(k)}`).join("<br>")}</td>
        <td class="hide-sm"><code>${esc(p.layout)}</code></td><td class="num">${num(p.tokens_per_s, 0)}</td>
        <td class="num hide-sm">${num(p.mfu * 100, 1)}%</td><td class="num">${num(p.cost_per_hour)}</td><td class="num">${num(p.cost)}</td>
        <td class="num">${num(p.hours, 1)}</td><td class="hide-sm">${esc(p.bottleneck)}</td></tr>`).join("")}
    </tbody></table></div>
  </section>
  <section class="card"><h2>Cost against time</h2><div id="pareto"></div>
    <p class="muted">Each point is a plan: further left is sooner, lower is cheaper. The frontier joins the plans no other plan beats on both;
    the chosen plan is the best one for the objective <em>${esc(doc.objective)}</em> within your constraints.</p></section>
  <section class="card"><h2>Why each plan is where it is</h2><ol class="notes" id="plan-why">
    ${rows.map((p, i) => `<li><strong>plan ${i + 1}</strong>: ${num(p.tokens_per_s, 0)} tokens/s at ${num(p.cost_per_hour)} ${esc(ccy)}/h,
      limited by <em>${esc(p.bottleneck)}</em>, memory headroom ${num(p.headroom_gb, 1)} GB${p.notes.length ? "; " + p.notes.map(esc).join("; ") : ""}.</li>`).join("")}
  </ol><p class="muted">Searched ${num(doc.stats.options, 0)} group options, ${num(doc.stats.combinations, 0)} combinations in ${num(doc.stats.seconds, 2)} s
    (${doc.stats.proven_optimal ? "proven optimal over the searched space" : "bound gap " + num(doc.stats.bound_gap * 100, 1) + "%"}).</p></section>`;
  paretoChart(document.getElementById("pareto"), doc.frontier, rows, {xLabel: `hours${per}`, yLabel: `cost (${ccy})${per}`});
}

/* ---------- jobs ---------- */
async function defaultJobYaml() {
  let dataset = "my-dataset", model = "llama";
  try {
    const ds = await api("/api/storage/datasets"), ms = await api("/api/storage/models");
    if (ds.items.length) dataset = ds.items[0].name;
    if (ms.items.length) model = ms.items[0].name;
  } catch (e) { /* keep the placeholders */ }
  return `# the job file of \`starverse train\` (the service sets run_dir, ledger and ports)
model: ${model}
dataset: ${dataset}
train: {steps: 20, seq_len: 32, global_batch: 4, micro_batch: 2}
checkpoint: {interval_steps: 5}
pool:
  currency: USD
  offers: [{accelerator: cpu, count: 2, price_per_hour: 0.4}]
`;
}

async function renderJobs() {
  const jobs = await api("/api/jobs");
  main.innerHTML = `
  <section class="card"><h1>Jobs</h1><div class="scroll"><table id="jobs-table"><thead><tr><th>name</th><th>state</th>
    <th class="num">step</th><th class="hide-sm">created</th></tr></thead><tbody>
    ${jobs.length ? jobs.map(j => `<tr><td><a href="#/job/${esc(j.id)}">${esc(j.name)}</a></td>
      <td><span class="badge ${esc(j.state)}">${esc(j.state)}</span></td><td class="num">${j.last_step ?? 0} / ${j.max_steps}</td>
      <td class="hide-sm">${when(j.created_at)}</td></tr>`).join("") : `<tr><td colspan="4" class="muted">No jobs yet.</td></tr>`}
    </tbody></table></div></section>
  <section class="card"><h2>Submit a training job</h2>
    <form id="submit-form"><label for="job-name">Name</label><input id="job-name" value="my-job" maxlength="128">
    <label for="job-yaml">Job file</label><textarea id="job-yaml" spellcheck="false"></textarea>
    <button type="submit" id="job-submit">Submit</button></form><p class="error" id="submit-error" role="alert"></p></section>`;
  document.getElementById("job-yaml").value = await defaultJobYaml();
  document.getElementById("submit-form").addEventListener("submit", async ev => {
    ev.preventDefault();
    const err = document.getElementById("submit-error");
    err.textContent = "";
    try {
      const yaml = `name: ${JSON.stringify(document.getElementById("job-name").value)}\n` + document.getElementById("job-yaml").value;
      const job = await api("/api/jobs", {method: "POST", body: yaml, headers: {"Content-Type": "application/yaml"}});
      location.hash = `#/job/${job.id}`;
    } catch (e) { err.textContent = e.message; }
  });
  if (jobs.some(j => j.state === "queued" || j.state === "running")) pollTimer = setTimeout(route, 3000);
}

async function renderJob(id) {
  const state = {after: 0, samples: []};
  const job = await api(`/api/jobs/${encodeURIComponent(id)}`);
  main.innerHTML = `
  <section class="card"><h1 id="job-title">${esc(job.name)} <span class="badge" id="job-state"></span></h1>
    <div class="bar" aria-label="progress"><span id="job-bar" style="width:0"></span></div>
    <dl class="kv" id="job-kv"></dl>
    <button type="button" id="btn-stop" class="danger">Stop</button> <button type="button" id="btn-resume" class="secondary">Resume</button>
    <p class="error" id="job-error" role="alert"></p></section>
  <div class="grid2">
    <section class="card"><h2>Loss</h2><div id="chart-loss"></div></section>
    <section class="card"><h2>Tokens/s</h2><div id="chart-tps"></div></section>
  </div>
  <div class="grid2">
    <section class="card"><h2>Batch share per rank</h2><div id="chart-shares"></div></section>
    <section class="card"><h2>Events</h2><ul class="events" id="events"></ul></section>
  </div>
  <div class="grid2">
    <section class="card"><h2>Checkpoints</h2><div class="scroll" id="checkpoints"></div></section>
    <section class="card"><h2>Bill</h2><div id="bill"></div></section>
  </div>
  <section class="card"><h2>Log</h2><pre class="log" id="log"></pre></section>`;
  document.getElementById("btn-stop").addEventListener("click", () => act(`/api/jobs/${id}/stop`, {}));
  document.getElementById("btn-resume").addEventListener("click", () => act(`/api/jobs/${id}/resume`, {}));

  async function act(path, body) {
    try { await api(path, {method: "POST", json: body}); await refresh(); }
    catch (e) { document.getElementById("job-error").textContent = e.message; }
  }

  async function refresh() {
    if (!location.hash.startsWith(`#/job/${id}`)) return;
    const doc = await api(`/api/jobs/${encodeURIComponent(id)}/progress?after=${state.after}`);
    const j = doc.job;
    state.samples.push(...doc.samples);
    if (doc.samples.length) state.after = doc.samples[doc.samples.length - 1].id;
    const active = j.state === "queued" || j.state === "running";
    const badge = document.getElementById("job-state");
    badge.textContent = j.state; badge.className = `badge ${j.state}`;
    document.getElementById("job-bar").style.width = `${Math.min(100, 100 * (j.last_step || 0) / Math.max(1, j.max_steps))}%`;
    const last = state.samples[state.samples.length - 1];
    const lastTps = state.samples.filter(x => x.tokens_per_s != null).pop();
    document.getElementById("job-kv").innerHTML = `<dt>step</dt><dd id="job-step">${j.last_step ?? 0} / ${j.max_steps}</dd>
      <dt>loss</dt><dd>${last ? num(last.loss, 4) : "–"}</dd><dt>tokens/s</dt><dd>${lastTps ? num(lastTps.tokens_per_s, 0) : "–"}</dd>
      <dt>launches</dt><dd>${j.launches}</dd><dt>started</dt><dd>${when(j.started_at)}</dd><dt>finished</dt><dd>${when(j.finished_at)}</dd>
      ${j.stop_reason ? `<dt>why it stopped</dt><dd>${esc(j.stop_reason)}</dd>` : ""}`;
    document.getElementById("btn-stop").disabled = !active;
    document.getElementById("btn-resume").disabled = active;
    const s = state.samples;
    lineChart(document.getElementById("chart-loss"), [{name: "loss", points: s.filter(x => x.loss != null).map(x => [x.step, x.loss])}],
              {xLabel: "step", yLabel: "loss"});
    lineChart(document.getElementById("chart-tps"), [{name: "tokens/s", points: s.filter(x => x.tokens_per_s != null).map(x => [x.step, x.tokens_per_s])}],
              {xLabel: "step", yLabel: "tokens/s"});
    const ranks = Math.max(0, ...s.map(x => x.shares.length));
    lineChart(document.getElementById("chart-shares"),
              Array.from({length: ranks}, (_, r) => ({name: `rank ${r}`, points: s.filter(x => x.shares.length > r).map(x => [x.step, x.shares[r]])})),
              {xLabel: "step", yLabel: "share of the batch", legend: true});
    document.getElementById("events").innerHTML = doc.events.slice().reverse().map(e =>
      `<li><time>${new Date(e.at * 1000).toLocaleTimeString()}</time><strong>${esc(e.kind)}</strong> ${esc(e.detail)}</li>`).join("");
    await Promise.all([showCheckpoints(id, active), showBill(id), showLog(id)]);
    if (active) pollTimer = setTimeout(() => refresh().catch(() => {}), 1000);
  }
  await refresh();
}

async function showCheckpoints(id, active) {
  const cks = await api(`/api/jobs/${encodeURIComponent(id)}/checkpoints`);
  const el = document.getElementById("checkpoints");
  el.innerHTML = cks.length ? `<table id="ckpt-table"><thead><tr><th class="num">step</th><th>reason</th><th class="num">loss</th>
    <th class="num hide-sm">MB</th><th></th></tr></thead><tbody>${cks.map(c => `<tr><td class="num">${c.step}</td><td>${esc(c.reason)}</td>
    <td class="num">${num(c.loss, 4)}</td><td class="num hide-sm">${num(c.size_bytes / 1e6, 2)}</td>
    <td><button type="button" class="secondary" data-rollback="${c.step}" ${active ? "disabled" : ""}>Roll back</button></td></tr>`).join("")}</tbody></table>`
    : '<p class="muted">No checkpoint yet.</p>';
  el.querySelectorAll("[data-rollback]").forEach(b => b.addEventListener("click", async () => {
    try { await api(`/api/jobs/${id}/rollback`, {method: "POST", json: {step: Number(b.dataset.rollback)}}); route(); }
    catch (e) { document.getElementById("job-error").textContent = e.message; }
  }));
}

async function showBill(id) {
  const b = await api(`/api/jobs/${encodeURIComponent(id)}/bill`);
  const ccy = b.currency || "";
  document.getElementById("bill").innerHTML = `<table id="bill-table"><tbody>
    ${b.leases.map(l => `<tr><td>${esc(l.device)} <span class="muted">${esc(l.accelerator)}, ${esc(l.mode)}, ${esc(l.price_per_hour)} ${esc(l.price_currency)}/h</span></td>
      <td class="num">${l.open ? "running" : l.seconds + " s"}</td><td class="num">${esc(l.charges)}</td></tr>`).join("")}
    ${b.credits.map(c => `<tr><td>insurance credit (${esc(c.kind)})</td><td class="num">${c.seconds} s</td><td class="num">−${esc(c.amount)}</td></tr>`).join("")}
    <tr><th>charges</th><td></td><td class="num">${esc(b.charges)} ${esc(ccy)}</td></tr>
    <tr><th>insurance credits</th><td></td><td class="num">${Number(b.credit) ? "−" : ""}${esc(b.credit)} ${esc(ccy)}</td></tr>
    <tr><th>net</th><td></td><td class="num" id="bill-net"><strong>${esc(b.net)} ${esc(ccy)}</strong></td></tr></tbody></table>
    ${b.events.length ? `<h3>Training events (ledger)</h3><p class="muted" id="ledger-events">${b.events.map(e =>
      `${esc(e.kind)}${e.step != null ? " @" + e.step : ""}`).join(" · ")}</p>` : ""}`;
}

async function showLog(id) {
  const el = document.getElementById("log");
  const text = await api(`/api/jobs/${encodeURIComponent(id)}/logs`);
  const atEnd = el.scrollTop + el.clientHeight >= el.scrollHeight - 4;
  el.textContent = typeof text === "string" ? text : JSON.stringify(text);
  if (atEnd) el.scrollTop = el.scrollHeight;
}

/* ---------- bill ---------- */
async function renderBill() {
  const [byDay, byJob, bal, jobs] = await Promise.all([api("/api/bill?by=day"), api("/api/bill?by=job"), api("/api/balance"), api("/api/jobs")]);
  const names = Object.fromEntries(jobs.map(j => [j.id, j.name]));
  const table = (bill, keyName, label) => `<table id="bill-by-${keyName}"><thead><tr><th>${label}</th><th class="num">seconds</th>
    <th class="num">charges</th><th class="num">credits</th><th class="num">net</th></tr></thead><tbody>
    ${bill.lines.map(l => `<tr><td>${keyName === "job" ? `<a href="#/job/${esc(l.key)}">${esc(names[l.key] || l.key)}</a>` : esc(l.key)}</td>
      <td class="num">${l.seconds}</td><td class="num">${esc(l.charges)}</td><td class="num">${esc(l.credits)}</td><td class="num">${esc(l.net)} ${esc(l.currency)}</td></tr>`).join("")
      || `<tr><td colspan="5" class="muted">Nothing billed yet.</td></tr>`}
    ${bill.totals.map(t => `<tr><th>total</th><td class="num">${t.seconds}</td><td class="num">${esc(t.charges)}</td><td class="num">${esc(t.credits)}</td>
      <td class="num"><strong>${esc(t.net)} ${esc(t.currency)}</strong></td></tr>`).join("")}
    </tbody></table>${bill.accrued.length ? `<p class="muted">Running jobs have accrued ${bill.accrued.map(a => `${esc(a.charges)} ${esc(a.currency)}`).join(", ")} so far (not in the totals yet).</p>` : ""}`;
  main.innerHTML = `
  <section class="card"><h1>Bill</h1><dl class="kv" id="balance">
    <dt>paid in</dt><dd>${esc(bal.paid_in)} ${esc(bal.currency)}</dd><dt>charged</dt><dd>${esc(bal.charged)} ${esc(bal.currency)}</dd>
    <dt>insurance credits</dt><dd>${esc(bal.insurance_credits)} ${esc(bal.currency)}</dd>
    <dt>balance</dt><dd id="balance-remaining"><strong>${esc(bal.remaining)} ${esc(bal.currency)}</strong></dd></dl>
    <h2>Credits and top-ups</h2><ul class="notes">${bal.entries.map(e => `<li>${when(e.at)}: ${esc(e.kind)} ${esc(e.amount)} ${esc(bal.currency)} — ${esc(e.note)}</li>`).join("")}</ul></section>
  <section class="card"><h2>By day</h2><div class="scroll">${table(byDay, "day", "day (UTC)")}</div></section>
  <section class="card"><h2>By job</h2><div class="scroll">${table(byJob, "job", "job")}</div></section>`;
}

(async function start() {
  if (token()) {
    try { const who = await api("/api/whoami"); document.getElementById("who").textContent = `tenant ${who.tenant}`; }
    catch (e) { /* signOut already ran */ }
  }
  route();
})();
