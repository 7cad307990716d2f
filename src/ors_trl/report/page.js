(function () {
  "use strict";
  var EPISODES = JSON.parse(document.getElementById("episode-data").textContent);
  var PAGE = 50, LONG = 800;
  var $ = function (id) { return document.getElementById(id); };
  var list = $("episode-list"), more = $("more"), count = $("episode-count");
  var filters = { env: $("f-env"), task: $("f-task"), run: $("f-run"), fail: $("f-fail"), min: $("f-min"),
                  max: $("f-max") };

  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function fmt(x) {
    if (x === null || x === undefined) return "–";
    if (typeof x === "number") return Number.isInteger(x) ? String(x) : String(Math.round(x * 10000) / 10000);
    return String(x);
  }
  function show(v) {
    if (typeof v === "string") return v;
    try { return JSON.stringify(v, null, 2); } catch (err) { return String(v); }
  }
  function tag(text, cls) { return el("span", "tag " + (cls || ""), text); }
  function kv(parent, pairs) {
    var line = el("div", "kv");
    pairs.forEach(function (p) {
      if (p[1] === undefined || p[1] === null || p[1] === "") return;
      line.appendChild(document.createTextNode(p[0] + " "));
      line.appendChild(el("b", null, fmt(p[1])));
      line.appendChild(document.createTextNode("   "));
    });
    if (line.childNodes.length) parent.appendChild(line);
  }
  // Text as it is in the record; long text collapsed (whole, never cut).
  function block(parent, label, value, cls) {
    if (value === undefined || value === null) return;
    var s = show(value), lines = s.split("\n").length;
    if (s.length > LONG || lines > 16) {
      var d = el("details", cls), sum = el("summary", "label");
      sum.textContent = label + " (" + s.length + " characters, " + lines + " lines): " +
        s.slice(0, 100).replace(/\s+/g, " ") + "…";
      d.appendChild(sum);
      d.appendChild(el("pre", null, s));
      parent.appendChild(d);
    } else {
      parent.appendChild(el("div", "label", label));
      parent.appendChild(el("pre", cls, s));
    }
  }
  function errorLine(parent, error, prefix) {
    if (!error) return;
    var text = typeof error === "object" ? (error.kind || "error") + (error.reason ? " (" + error.reason + ")" : "") +
      ": " + (error.message === undefined ? "" : show(error.message)) : show(error);
    parent.appendChild(el("div", "err", prefix + text));
  }
  // An episode's images by hash: the thumbnail made when the page was written, else what the record says of it.
  function images(parent, ep, shas) {
    if (!Array.isArray(shas) || !shas.length) return;
    var all = ep.rec.images && typeof ep.rec.images === "object" ? ep.rec.images : {}, row = el("div", "images");
    shas.forEach(function (sha) {
      var info = Object.prototype.hasOwnProperty.call(all, sha) && all[sha] && typeof all[sha] === "object" ?
        all[sha] : {};
      var url = ep.thumbs && Object.prototype.hasOwnProperty.call(ep.thumbs, sha) ? ep.thumbs[sha] : null;
      var fig = el("figure", "thumb"), text = (info.mime_type || "image") + " " + fmt(info.width) + "×" +
        fmt(info.height) + ", " + fmt(info.bytes) + " bytes";
      if (typeof url === "string" && url.indexOf("data:image/png;base64,") === 0) {
        var img = document.createElement("img");
        img.src = url;
        img.alt = text;
        img.title = "sha256 " + sha;
        fig.appendChild(img);
      } else {
        fig.appendChild(el("div", "nothumb", info.error ? "not shown to the model: " + show(info.error) :
          "no image file beside the log"));
      }
      fig.appendChild(el("figcaption", null, text));
      row.appendChild(fig);
    });
    parent.appendChild(row);
  }
  function call(parent, c, title, ep) {
    var box = el("div", "call" + (c.error ? " failed" : ""));
    var head = el("div");
    head.appendChild(el("b", null, title + (c.name !== undefined && c.name !== null ? c.name : c.tool || "?")));
    if (c.remote_name && c.remote_name !== c.name) head.appendChild(el("span", "kv", "  → remote tool " + c.remote_name));
    if (c.error) head.appendChild(tag("failed: " + (c.error.kind || "error"), "bad"));
    if (c.status === "not_run") head.appendChild(tag("not run", "warn"));
    box.appendChild(head);
    kv(box, [["status", c.status], ["reward", c.reward], ["finished", c.finished], ["seconds", c.seconds], ["id", c.id]]);
    if (c.message !== undefined) block(box, "final message", c.message);
    if (c.arguments !== undefined) block(box, "arguments", c.arguments);
    if (c.remote_arguments !== undefined) block(box, "arguments on the wire", c.remote_arguments);
    errorLine(box, c.error, "failure: ");
    if (c.skipped) box.appendChild(el("div", "kv", c.skipped));
    block(box, "output", c.output);
    if (ep) images(box, ep, c.images);
    if (c.metadata !== undefined && c.metadata !== null) block(box, "metadata", c.metadata);
    parent.appendChild(box);
  }
  var SHOWN = {version: 1, run: 1, source: 1, environment: 1, split: 1, task_index: 1, started_at: 1, system: 1,
    prompt: 1, turns: 1, final: 1, reward: 1, group_reward: 1, finished: 1, end_reason: 1, unscored: 1,
    tool_calls: 1, tool_failures: 1, error: 1, timings: 1, images: 1, prompt_images: 1};
  function body(ep) {
    var r = ep.rec, b = el("div", "ep-body");
    kv(b, [["environment", ep.env], ["task", ep.task], ["run", ep.run], ["source", r.source],
           ["started", r.started_at], ["record version", r.version]]);
    kv(b, [["reward", r.reward], ["group reward", r.group_reward], ["finished", r.finished],
           ["end reason", r.end_reason], ["unscored", r.unscored], ["tool calls", r.tool_calls],
           ["failed", r.tool_failures]]);
    if (r.timings && typeof r.timings === "object") {
      kv(b, Object.keys(r.timings).map(function (k) { return ["time " + k + " (s)", r.timings[k]]; }));
    }
    errorLine(b, r.error, "episode error: ");
    block(b, "system", r.system);
    block(b, "prompt", r.prompt);
    images(b, ep, r.prompt_images);
    (Array.isArray(r.turns) ? r.turns : []).forEach(function (t, i) {
      if (!t || typeof t !== "object") return;
      var turn = el("div", "turn");
      turn.appendChild(el("div", "label", "turn " + (t.index === undefined ? i : t.index) +
        (t.generation_seconds !== undefined ? " (generation " + fmt(t.generation_seconds) + " s)" : "")));
      if (t.assistant !== null && t.assistant !== undefined && t.assistant !== "") block(turn, "assistant", t.assistant);
      (Array.isArray(t.tool_calls) ? t.tool_calls : []).forEach(function (c) {
        if (c && typeof c === "object") call(turn, c, "tool call: ", ep);
      });
      b.appendChild(turn);
    });
    if (r.final && typeof r.final === "object") {
      if (r.final.tool) call(b, r.final, "final message → terminal tool: ");
      else block(b, "final message", r.final.message);
    }
    if (Array.isArray(r.rewards) && r.rewards.length) block(b, "rewards per call", JSON.stringify(r.rewards));
    var rest = {};
    Object.keys(r).forEach(function (k) { if (!SHOWN[k] && k !== "rewards" && r[k] !== null) rest[k] = r[k]; });
    if (Object.keys(rest).length) block(b, "other fields", rest);
    return b;
  }
  function row(ep) {
    var d = el("details", "episode"), s = el("summary"), r = ep.rec;
    d.id = "episode-" + ep.id;
    s.appendChild(el("b", null, ep.env + " · " + ep.task));
    s.appendChild(document.createTextNode("  reward " + fmt(ep.reward)));
    if (r.group_reward !== undefined && r.group_reward !== null) s.appendChild(document.createTextNode(
      " · group " + fmt(r.group_reward)));
    s.appendChild(tag(r.end_reason || "no end reason", r.finished ? "good" : ""));
    ep.tags.forEach(function (t) { s.appendChild(tag(t, t.indexOf("unscored") === 0 ? "warn" : "bad")); });
    s.appendChild(el("span", "kv", "  " + fmt(r.tool_calls) + " call(s) · run " + ep.run));
    d.appendChild(s);
    d.addEventListener("toggle", function () {
      if (d.open && d.childNodes.length === 1) d.appendChild(body(ep));
    });
    return d;
  }
  function num(input) { var v = parseFloat(input.value); return isNaN(v) ? null : v; }
  function matches(ep) {
    var f = filters, lo = num(f.min), hi = num(f.max);
    if (f.env.value && ep.env !== f.env.value) return false;
    if (f.task.value && ep.task !== f.task.value) return false;
    if (f.run.value && ep.run !== f.run.value) return false;
    if (f.fail.value === "*" && !ep.tags.length) return false;
    if (f.fail.value && f.fail.value !== "*" && ep.tags.indexOf(f.fail.value) < 0) return false;
    if ((lo !== null || hi !== null) && ep.reward === null) return false;
    if (lo !== null && ep.reward < lo) return false;
    if (hi !== null && ep.reward > hi) return false;
    return true;
  }
  var filtered = [], shown = 0;
  function page() {
    var end = Math.min(filtered.length, shown + PAGE);
    for (var i = shown; i < end; i++) list.appendChild(row(filtered[i]));
    shown = end;
    more.hidden = shown >= filtered.length;
  }
  function apply() {
    filtered = EPISODES.filter(matches);
    list.replaceChildren();
    shown = 0;
    page();
    count.textContent = filtered.length + " of " + EPISODES.length + " embedded episode(s) match." +
      (filtered.length || !filters.task.value ? "" : " No episode of this task is in the embedded sample.");
  }
  function options(select, values) {  // keeps the fixed options ("all", "any failure")
    var keep = select.value;
    Array.from(select.options).forEach(function (o) { if (o.value && o.value !== "*") o.remove(); });
    values.forEach(function (v) { var o = el("option", null, v); o.value = v; select.appendChild(o); });
    select.value = values.indexOf(keep) >= 0 ? keep : "";
  }
  function uniq(key, eps) {
    var seen = {};
    eps.forEach(function (ep) { [].concat(ep[key]).forEach(function (v) { seen[v] = 1; }); });
    return Object.keys(seen).sort(function (a, b) { return a.localeCompare(b, undefined, {numeric: true}); });
  }
  function taskOptions() {
    var env = filters.env.value;
    options(filters.task, uniq("task", EPISODES.filter(function (ep) { return !env || ep.env === env; })));
  }
  options(filters.env, uniq("env", EPISODES));
  options(filters.run, uniq("run", EPISODES));
  options(filters.fail, uniq("tags", EPISODES));
  taskOptions();
  filters.env.addEventListener("change", function () { taskOptions(); apply(); });
  ["task", "run", "fail"].forEach(function (k) { filters[k].addEventListener("change", apply); });
  ["min", "max"].forEach(function (k) { filters[k].addEventListener("input", apply); });
  $("f-clear").addEventListener("click", function () {
    ["env", "run", "fail", "min", "max"].forEach(function (k) { filters[k].value = ""; });
    taskOptions(); filters.task.value = ""; apply();
  });
  function expand() { list.querySelectorAll("details.episode").forEach(function (d) { d.open = true; }); }
  $("f-expand").addEventListener("click", expand);
  more.addEventListener("click", page);

  document.querySelectorAll("table.sortable").forEach(function (table) {
    var heads = table.tHead.rows[0].cells;
    Array.from(heads).forEach(function (th, col) {
      th.addEventListener("click", function () {
        var up = th.getAttribute("aria-sort") !== "ascending", numeric = th.getAttribute("data-type") === "num";
        Array.from(heads).forEach(function (h) { h.removeAttribute("aria-sort"); });
        th.setAttribute("aria-sort", up ? "ascending" : "descending");
        var rows = Array.from(table.tBodies[0].rows);
        rows.sort(function (a, b) {
          var x = a.cells[col], y = b.cells[col], c;
          if (numeric) {
            var p = parseFloat(x.getAttribute("data-v")), q = parseFloat(y.getAttribute("data-v"));
            p = isNaN(p) ? -Infinity : p; q = isNaN(q) ? -Infinity : q;
            c = p === q ? 0 : (p < q ? -1 : 1);
          } else {
            c = x.textContent.localeCompare(y.textContent, undefined, {numeric: true});  // test #2 before test #19
          }
          return up ? c : -c;
        });
        rows.forEach(function (r) { table.tBodies[0].appendChild(r); });
      });
    });
  });
  document.querySelectorAll("tr.task").forEach(function (tr) {
    tr.addEventListener("click", function () {
      filters.env.value = tr.getAttribute("data-env");
      taskOptions();
      var task = tr.getAttribute("data-task");
      if (Array.from(filters.task.options).every(function (o) { return o.value !== task; })) {
        var o = el("option", null, task); o.value = task; filters.task.appendChild(o);
      }
      filters.task.value = task;
      ["run", "fail", "min", "max"].forEach(function (k) { filters[k].value = ""; });
      apply();
      $("episodes").scrollIntoView();
    });
  });
  apply();
  if (location.hash === "#expand") expand();
  document.body.setAttribute("data-report-ready", "1");
})();
