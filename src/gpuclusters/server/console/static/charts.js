// GPU charts (node, cluster and job pages): uPlot over the #charts
// element's data-url, refreshed every 5 s. One line per series: a GPU
// (numbers from the heartbeats' history, core/telemetry.py) or a label the
// metrics database's series got (services/gpu_charts.py).
(function () {
  "use strict";
  const root = document.getElementById("charts");
  if (!root || typeof uPlot === "undefined") return;
  const palette = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777"];
  const plots = new Map();

  function draw(el, data) {
    const metric = el.dataset.metric;
    const columns = [data.t].concat(data[metric] || []);
    const width = Math.max(320, el.clientWidth || 600);
    let plot = plots.get(metric);
    if (plot && plot.series.length !== columns.length) {
      plot.destroy();
      plot = undefined;
    }
    if (!plot) {
      const series = [{}].concat(data.gpus.map((g, i) => ({
        label: typeof g === "number" ? "GPU " + g : g, stroke: palette[i % palette.length], width: 1.5,
      })));
      plot = new uPlot({ title: el.dataset.title, width: width, height: 220, series: series }, columns, el);
      plots.set(metric, plot);
    } else {
      plot.setData(columns);
    }
    el.dataset.points = String(data.t.length);
  }

  async function refresh() {
    try {
      const r = await fetch(root.dataset.url, { credentials: "same-origin", headers: { Accept: "application/json" } });
      if (!r.ok) return;
      const data = await r.json();
      root.dataset.gpus = String(data.gpus.length);
      root.querySelectorAll(".chart").forEach((el) => draw(el, data));
    } catch (e) {
      // The next refresh tries again.
    }
  }
  refresh();
  setInterval(refresh, 5000);
})();
