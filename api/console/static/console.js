// The console's one script: it asks before an action, follows a sandbox's
// audit as it happens, and draws the egress charts with uPlot. Every page
// works without it (actions ask on a page of their own; the audit and the
// charts' figures are on the page and at /ui/egress). It builds elements
// with textContent only: nothing it shows is read as HTML.
'use strict';
(function () {
  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }

  // Ask first: confirm(), then the form goes with confirm=yes.
  document.querySelectorAll('form[data-confirm]').forEach(function (f) {
    f.addEventListener('submit', function (ev) {
      if (!window.confirm(f.dataset.confirm)) {
        ev.preventDefault();
        return;
      }
      var c = f.querySelector('input[name=confirm]');
      if (!c) {
        c = el('input');
        c.type = 'hidden';
        c.name = 'confirm';
        f.appendChild(c);
      }
      c.value = 'yes';
    });
  });

  // The live audit: server-sent events, newest on top.
  var list = document.getElementById('events');
  if (list && list.dataset.stream && window.EventSource) {
    var seen = new Set();
    list.querySelectorAll('li[data-key]').forEach(function (li) { seen.add(li.dataset.key); });
    var live = document.getElementById('live');
    var liveText = document.getElementById('live-text');
    var follow = document.getElementById('follow');
    var held = [];
    function status(cls, text) {
      live.hidden = false;
      live.className = 'live ' + cls;
      liveText.textContent = text;
    }
    function show(v) {
      var li = el('li', 'event ' + v.decision);
      li.dataset.key = v.key;
      var main = el('div', 'ev-main');
      var t = el('time', null, v.clock);
      t.setAttribute('datetime', v.time);
      main.appendChild(t);
      main.appendChild(el('span', 'badge ' + v.decision, v.decision === 'deny' ? 'refused' : 'allowed'));
      var dest = el('span', 'dest');
      dest.appendChild(el('b', null, v.host));
      if (v.port) dest.appendChild(document.createTextNode(':' + v.port));
      if (v.method) dest.appendChild(el('span', 'req', ' ' + v.method + ' ' + (v.path || '')));
      main.appendChild(dest);
      if (v.status) main.appendChild(el('span', 'status', v.status));
      main.appendChild(el('code', 'code', v.code));
      main.appendChild(el('span', 'kind', v.kind));
      var cmd = el('span', 'cmd', v.cmd);
      cmd.title = 'the process that connected';
      main.appendChild(cmd);
      main.appendChild(el('span', 'bytes', v.bytes));
      li.appendChild(main);
      if (v.fix || v.error) {
        var why = el('div', 'ev-why');
        var p = el('p', 'reason');
        p.appendChild(el('b', null, v.fix ? 'Why: ' : 'Error: '));
        p.appendChild(document.createTextNode(v.fix ? v.reason : v.error));
        why.appendChild(p);
        if (v.fix) {
          var fx = el('p', 'fix');
          fx.appendChild(el('b', null, 'Fix: '));
          fx.appendChild(document.createTextNode(v.fix));
          why.appendChild(fx);
        }
        li.appendChild(why);
      }
      li.classList.add('new');
      list.insertBefore(li, list.firstChild);
      while (list.children.length > 500) list.removeChild(list.lastChild);
      var none = document.getElementById('no-events');
      if (none) none.remove();
    }
    var es = new EventSource(list.dataset.stream);
    es.addEventListener('open', function () { status('on', 'live'); });
    es.addEventListener('error', function () {
      if (es.readyState === EventSource.CLOSED) status('off', 'stopped: reload the page');
      else status('wait', 'reconnecting…');
    });
    es.addEventListener('audit', function (m) {
      var v = JSON.parse(m.data);
      if (seen.has(v.key)) return;
      seen.add(v.key);
      if (follow && !follow.checked) {
        held.push(v);
        status('paused', 'paused · ' + held.length + ' new');
        return;
      }
      show(v);
    });
    es.addEventListener('end', function (m) {
      es.close();
      status('off', JSON.parse(m.data).reason);
    });
    if (follow) {
      follow.addEventListener('change', function () {
        if (follow.checked) {
          held.forEach(show);
          held = [];
          if (es.readyState !== EventSource.CLOSED) status('on', 'live');
        }
      });
    }
  }

  // The egress charts.
  function fmtBytes(n) {
    if (n == null) return '';
    var u = ['B', 'KB', 'MB', 'GB', 'TB'], i = 0;
    while (Math.abs(n) >= 1024 && i < u.length - 1) { n /= 1024; i++; }
    return (i ? n.toFixed(1) : n) + ' ' + u[i];
  }
  var palette = ['#c62828', '#ef6c00', '#6a1b9a', '#1565c0', '#00838f', '#5d4037', '#9e9d24', '#ad1457'];
  function chart(box, title, series, data, values) {
    var fig = el('figure', 'chart');
    fig.appendChild(el('figcaption', null, title));
    box.appendChild(fig);
    var steps = uPlot.paths && uPlot.paths.stepped ? uPlot.paths.stepped({ align: 1 }) : undefined;
    series.forEach(function (s) { s.paths = steps; s.points = { show: false }; });
    var opts = {
      width: Math.max(fig.clientWidth, 240), height: 170,
      series: [{}].concat(series),
      scales: { x: { time: true } },
      axes: [{ stroke: '#555' }, { stroke: '#555', size: 60, values: values }],
      legend: { live: false },
      cursor: { drag: { x: false, y: false } }
    };
    var u = new uPlot(opts, data, fig);
    window.addEventListener('resize', function () { u.setSize({ width: Math.max(fig.clientWidth, 240), height: 170 }); });
    return u;
  }
  function plural(n, one, many) { return n + ' ' + (n === 1 ? one : many); }
  function counts(u, vals) { return vals.map(function (v) { return Number.isInteger(v) ? v : ''; }); }
  function bytes(u, vals) { return vals.map(fmtBytes); }
  document.querySelectorAll('[data-egress]').forEach(function (box) {
    fetch(box.dataset.egress, { credentials: 'same-origin', headers: { Accept: 'application/json' } })
      .then(function (r) {
        return r.json().then(function (j) {
          if (!r.ok) throw new Error(j.error || r.statusText);
          return j;
        });
      })
      .then(function (e) {
        box.textContent = '';
        if (!window.uPlot) throw new Error('the chart library did not load');
        var note = plural(e.events, 'event', 'events') + ' from ' + plural(e.sandboxes, 'sandbox', 'sandboxes') +
          ', in buckets of ' + (e.step >= 3600 ? plural(e.step / 3600, 'hour', 'hours') : e.step >= 60 ? (e.step / 60) + ' min' : e.step + ' s');
        if (e.note) note += ' (' + e.note + ')';
        box.appendChild(el('p', 'chart-note', note));
        if (e.capped) box.appendChild(el('p', 'warn', 'Capped: the console read as many events as it may for one chart; it shows part of the span.'));
        chart(box, 'Requests and connections', [
          { label: 'allowed', stroke: '#2e7d32', fill: 'rgba(46,125,50,0.08)', width: 2 },
          { label: 'refused', stroke: '#c62828', fill: 'rgba(198,40,40,0.08)', width: 2 }
        ], [e.times, e.allowed, e.refused], counts);
        chart(box, 'Bytes', [
          { label: 'sent', stroke: '#1565c0', width: 2, value: function (u, v) { return fmtBytes(v); } },
          { label: 'received', stroke: '#6a1b9a', width: 2, value: function (u, v) { return fmtBytes(v); } }
        ], [e.times, e.sent, e.received], bytes);
        // Always a third chart, so the grid is whole: a flat line says
        // there was no refusal.
        var rs = (e.refusals && e.refusals.length) ? e.refusals.slice(0, palette.length) : [{ code: 'none', counts: e.refused }];
        chart(box, 'Refusals by code', rs.map(function (s, i) {
          return { label: s.code, stroke: s.code === 'none' ? '#9aa5b1' : palette[i], width: 2 };
        }), [e.times].concat(rs.map(function (s) { return s.counts; })), counts);
      })
      .catch(function (err) {
        box.textContent = '';
        box.appendChild(el('p', 'error', 'The charts could not be drawn: ' + err.message));
      });
  });
})();
