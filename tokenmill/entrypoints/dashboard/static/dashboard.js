// The tokenmill dashboard: polls dashboard/api/stats and redraws the cards and charts.
"use strict";

const REFRESH_MS = 1000;
const CHART_HEIGHT = 180;

const SERIES = {
  tokens: [["Generated", "generation_tokens_per_s", "#2f6fdf"], ["Prompt", "prompt_tokens_per_s", "#e38a1d"]],
  requests: [["Running", "running", "#2e9b4f"], ["Waiting", "waiting", "#c73b3b"]],
  kv: [["KV used", "kv_percent", "#7a4fc9"]],
  ttft: [["p50", "ttft_p50_ms", "#2f6fdf"], ["p90", "ttft_p90_ms", "#9bb8ee"]],
  tpot: [["p50", "tpot_p50_ms", "#2e9b4f"], ["p90", "tpot_p90_ms", "#9ed3ad"]],
};

const charts = {};

function makeChart(name) {
  const el = document.getElementById("chart-" + name);
  const opts = {
    width: Math.max(el.clientWidth, 300),
    height: CHART_HEIGHT,
    series: [{}].concat(SERIES[name].map(([label, , stroke]) => ({ label, stroke, width: 2, spanGaps: true }))),
    axes: [{}, { size: 60 }],
  };
  return new uPlot(opts, [[], ...SERIES[name].map(() => [])], el);
}

function fmt(value, digits) {
  if (value === null || value === undefined || Number.isNaN(value)) return "-";
  return Number(value).toFixed(digits);
}

function setText(id, text) {
  document.getElementById(id).textContent = text;
}

function renderCards(current) {
  setText("running", fmt(current.running, 0));
  setText("waiting", fmt(current.waiting, 0));
  setText("kv-usage", fmt(current.kv_cache_usage * 100, 1) + " %");
  setText("gen-tps", fmt(current.generation_tokens_per_s, 1));
  setText("prompt-tps", fmt(current.prompt_tokens_per_s, 1));
  setText("ttft-p50", fmt(current.ttft_p50_ms, 1));
  setText("tpot-p50", fmt(current.tpot_p50_ms, 1));
  setText("hit-rate", current.prefix_cache_hit_rate === null ? "-" : fmt(current.prefix_cache_hit_rate * 100, 1) + " %");
  setText("requests-total", fmt(current.requests_total, 0));
  setText("generation-tokens-total", fmt(current.generation_tokens_total, 0));
}

function renderCharts(points) {
  for (const p of points) p.kv_percent = p.kv_cache_usage * 100;
  const times = points.map((p) => p.t);
  for (const name of Object.keys(SERIES)) {
    if (!charts[name]) charts[name] = makeChart(name);
    charts[name].setData([times, ...SERIES[name].map(([, key]) => points.map((p) => p[key]))]);
  }
}

function renderConfig(model) {
  const table = document.getElementById("config");
  table.replaceChildren();
  for (const [key, value] of Object.entries(model)) {
    const row = table.insertRow();
    row.insertCell().textContent = key;
    row.insertCell().textContent = value === null ? "-" : String(value);
  }
  setText("model-name", model.served_model_name);
}

let configShown = false;

async function refresh() {
  const status = document.getElementById("status");
  try {
    const response = await fetch("dashboard/api/stats", { cache: "no-store" });
    if (!response.ok) throw new Error("HTTP " + response.status);
    const data = await response.json();
    if (!configShown) { renderConfig(data.model); configShown = true; }
    if (data.stats) {
      renderCards(data.stats.current);
      renderCharts(data.stats.points);
      status.textContent = "live";
    } else {
      status.textContent = "statistics off (--disable-log-stats)";
    }
    status.className = "status ok";
    setText("updated", new Date().toLocaleTimeString());
  } catch (err) {
    status.textContent = "unreachable: " + err.message;
    status.className = "status error";
  }
}

window.addEventListener("resize", () => {
  for (const [name, chart] of Object.entries(charts)) {
    chart.setSize({ width: Math.max(document.getElementById("chart-" + name).clientWidth, 300), height: CHART_HEIGHT });
  }
});

refresh();
setInterval(refresh, REFRESH_MS);
