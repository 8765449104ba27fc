// roce-trace web view: fills the page from the collector's fragments, refreshes them,
// shows the flows of a clicked node or link, and the flow named by #flow=… (shareable).
'use strict';
(function () {
  const $ = (s) => document.querySelector(s);
  const refreshMs = Number(document.body.dataset.refreshMs) || 5000;
  let token = sessionStorage.getItem('roce-trace-token');
  let selected = null; // [kind, key] of the clicked node or link, kept across refreshes

  async function get(url) {
    const headers = token ? { Authorization: 'Bearer ' + token } : {};
    const r = await fetch(url, { headers, cache: 'no-store' });
    if (r.status === 401) {
      const t = window.prompt('This collector asks for its HTTP bearer token:');
      if (t) {
        token = t.trim();
        sessionStorage.setItem('roce-trace-token', token);
        return get(url);
      }
      throw new Error('a bearer token is required');
    }
    if (!r.ok) throw new Error(url + ': ' + r.status + ' ' + (await r.text()).trim());
    return r.text();
  }

  function keyOf(el) {
    return el.classList.contains('node')
      ? ['node', el.dataset.node]
      : ['link', el.dataset.a + '\u0000' + el.dataset.b];
  }

  function select(el) {
    document.querySelectorAll('#map .selected').forEach((x) => x.classList.remove('selected'));
    const panel = $('#panel');
    if (!el) { selected = null; panel.hidden = true; return; }
    el.classList.add('selected');
    selected = keyOf(el);
    const name = selected[0] === 'node' ? el.dataset.node : el.dataset.a + ' — ' + el.dataset.b;
    const flows = (el.dataset.flows || '').split(' ').filter(Boolean);
    const total = Number(el.dataset.flowCount) || 0;
    const marks = (el.dataset.marks || '').split(' ').filter(Boolean);
    panel.replaceChildren();
    const h = document.createElement('h3');
    h.textContent = name;
    panel.append(h);
    const p = document.createElement('p');
    p.className = 'marks';
    p.textContent = marks.length ? 'marked: ' + marks.join(', ') : 'nothing located here';
    panel.append(p);
    // Each flow with what was located on it here (its state at this place).
    const named = {};
    for (const m of marks) {
      for (const id of (el.getAttribute('data-flows-' + m) || '').split(' ').filter(Boolean)) {
        (named[id] = named[id] || []).push(m);
      }
    }
    const ul = document.createElement('ul');
    for (const id of flows) {
      const li = document.createElement('li');
      const a = document.createElement('a');
      a.href = '#flow=' + encodeURIComponent(id);
      a.textContent = id;
      li.append(a);
      const state = document.createElement('span');
      state.className = 'state';
      state.dataset.marks = (named[id] || []).join(' ');
      state.textContent = named[id] ? ' — ' + named[id].join(', ') : ' — nothing located here';
      li.append(state);
      ul.append(li);
    }
    panel.append(ul);
    if (total > flows.length) {
      const more = document.createElement('p');
      more.textContent = (total - flows.length) + ' more flow(s): see /flows';
      panel.append(more);
    }
    panel.hidden = false;
  }

  function wire() {
    document.querySelectorAll('#map .node, #map .link').forEach((el) => {
      el.addEventListener('click', (e) => { e.stopPropagation(); select(el); });
      if (selected && keyOf(el).join('|') === selected.join('|')) select(el);
    });
  }

  // `reveal`: scroll to it (a link followed, a page opened), not on a refresh.
  async function showFlow(reveal) {
    const m = location.hash.match(/^#flow=(.+)$/);
    const box = $('#flow');
    if (!m) { box.hidden = true; box.replaceChildren(); return; }
    const id = decodeURIComponent(m[1]);
    try {
      box.innerHTML = await get('/ui/flow?id=' + encodeURIComponent(id));
    } catch (e) {
      box.textContent = 'flow ' + id + ': ' + e.message;
    }
    box.hidden = false;
    if (reveal === true) {
      select(null); // the list that led here gives the flow the room
      box.scrollIntoView();
    }
  }

  let first = true;
  async function refresh() {
    try {
      $('#main').innerHTML = await get('/ui/main');
      wire();
      $('#status').textContent = 'updated ' + new Date().toLocaleTimeString();
    } catch (e) {
      $('#status').textContent = 'not updated: ' + e.message;
    }
    await showFlow(first);
    first = false;
  }

  window.addEventListener('hashchange', () => showFlow(true));
  document.addEventListener('click', (e) => {
    if (!e.target.closest('#panel') && !e.target.closest('#map')) select(null);
  });
  refresh();
  setInterval(refresh, refreshMs);
})();
