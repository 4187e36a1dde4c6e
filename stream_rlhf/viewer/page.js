// view.html: renders the samples of the JSON in #data (stream_rlhf/viewer/page.py) and re-renders
// them when the iteration, the token colouring or the order changes. Text only ever goes in as
// textContent. A multi-turn sample (its `turns`: [start, end, kind] spans) shows one block per
// turn: policy tokens coloured, observation tokens shaded and left out of the colour scales and
// the mean KL (they carry no loss). A failed episode left out of training (`trained: false`,
// env.failed_episodes: mask) is marked so in its card, its tokens faded, and so is a sample
// dynamic sampling left out (`left_out`: algorithm.dynamic_sampling); a sample its length limit
// cut (`truncated`) says so.
"use strict";

const DATA = JSON.parse(document.getElementById("data").textContent);
const PAGE = 40;  // cards rendered at a time ("show more" adds the next ones)
const MAX_ALPHA = 0.7;
const SCALES = {  // colour of a token: [rgb below zero, rgb above zero]
  logprob: { low: "214, 39, 40", high: "214, 39, 40" },
  advantage: { low: "214, 39, 40", high: "22, 163, 74" },
  kl: { low: "8, 145, 178", high: "124, 58, 237" },
};
const state = { iteration: "all", colour: "logprob", order: "logged", shown: PAGE };

const mean = (values) => values.reduce((a, b) => a + b, 0) / Math.max(values.length, 1);
for (const s of DATA.samples) {  // s.policy[i]: token i carries loss (every token of a single-turn sample)
  s.policy = s.tokens.map(() => !s.turns);
  for (const [start, end, kind] of s.turns || []) s.policy.fill(kind === "policy", start, end);
}
const policyValues = (s, name) => (s[name] || []).filter((_, i) => s.policy[i]);
const largest = (name) => DATA.samples.reduce(  // no spread: a long log has too many tokens for one call
  (top, s) => policyValues(s, name).reduce((m, v) => Math.max(m, Math.abs(v)), top), 1e-9);
const LARGEST = { advantage: largest("advantage"), kl: largest("kl") };
for (const s of DATA.samples) s.meanKl = s.kl ? mean(policyValues(s, "kl")) : null;

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function fmt(value, digits = 3) {
  return value === null || value === undefined ? "n/a" : Number(value).toFixed(digits);
}

// Background of a token: log-prob shades by how unlikely it was (1 - p); advantage and KL by
// their size relative to the largest in the log, with one hue for each sign.
function tokenColour(sample, i) {
  const values = sample[state.colour];
  if (!values) return "transparent";
  const v = values[i];
  const scale = SCALES[state.colour];
  if (state.colour === "logprob") return `rgba(${scale.low}, ${(1 - Math.exp(v)) * MAX_ALPHA})`;
  const t = Math.max(-1, Math.min(1, v / LARGEST[state.colour]));
  return `rgba(${t < 0 ? scale.low : scale.high}, ${Math.abs(t) * MAX_ALPHA})`;
}

function legend() {
  const scale = SCALES[state.colour];
  const bar = document.getElementById("legend-bar");
  if (state.colour === "logprob") {
    bar.style.background = `linear-gradient(to right, rgba(${scale.low}, ${MAX_ALPHA}), rgba(${scale.low}, 0))`;
    document.getElementById("legend-low").textContent = "p = 0";
    document.getElementById("legend-high").textContent = "p = 1";
    return;
  }
  bar.style.background = `linear-gradient(to right, rgba(${scale.low}, ${MAX_ALPHA}), rgba(${scale.low}, 0) 50%, ` +
    `rgba(${scale.high}, 0) 50%, rgba(${scale.high}, ${MAX_ALPHA}))`;
  document.getElementById("legend-low").textContent = fmt(-LARGEST[state.colour]);
  document.getElementById("legend-high").textContent = "+" + fmt(LARGEST[state.colour]);
}

function tokenTitle(sample, i) {
  if (!sample.policy[i]) return `${JSON.stringify(sample.tokens[i])}  observation (no loss)`;
  const lp = sample.logprob[i];
  const kl = sample.kl ? `  KL ${fmt(sample.kl[i], 4)}` : "";
  return `${JSON.stringify(sample.tokens[i])}  log-prob ${fmt(lp)} (p ${fmt(Math.exp(lp))})  ` +
    `advantage ${fmt(sample.advantage[i])}${kl}`;
}

function card(sample) {
  const node = element("article", "sample");
  node.dataset.line = sample.line;
  node.dataset.reward = sample.reward;
  const meta = element("div", "meta");
  meta.append(
    element("span", "", `iteration ${sample.iteration} · mini-batch ${sample.minibatch} · sample ${sample.sample}`),
    element("span", "reward", `reward ${fmt(sample.reward)}`),
    element("span", sample.staleness > 0 ? "stale" : "",
            `policy v${sample.policy_version} · staleness ${sample.staleness}`),
    element("span", "", `mean KL ${fmt(sample.meanKl, 4)}`),
    element("span", "", `${sample.tokens.length} tokens · line ${sample.line}`),
  );
  if (sample.turns) {
    const turns = sample.turns.filter(([, , kind]) => kind === "policy").length;
    meta.append(element("span", "turns", `${turns} turn${turns === 1 ? "" : "s"}`));
  }
  if (sample.truncated) {  // rollout.max_new_tokens or env.max_episode_tokens ended it
    meta.append(element("span", "cut", "cut at its length limit"));
  }
  if (!sample.trained) {  // a failed episode under env.failed_episodes: mask
    node.classList.add("untrained");
    meta.append(element("span", "untrained", "not trained: a failed episode (env.failed_episodes: mask)"));
  } else if (sample.left_out) {  // its group left out by algorithm.dynamic_sampling
    node.classList.add("untrained");
    meta.append(element("span", "untrained", `not trained: ${sample.left_out} (algorithm.dynamic_sampling)`));
  }
  const prompt = element("div", "prompt row");
  prompt.append(element("span", "label", "prompt"));
  sample.images.forEach((path, i) => {
    const src = sample.thumbnails[i];
    if (src) {
      const img = element("img");
      img.src = src;
      img.alt = img.title = path;
      prompt.append(img);
    } else {
      prompt.append(element("span", "missing", `image not readable: ${path}`));
    }
  });
  prompt.append(element("pre", "", sample.prompt));
  const response = element("div", "row");
  const tokens = element("div", "response");
  if (sample.turns) {
    tokens.classList.add("episode");
    let policyTurns = 0;
    for (const [start, end, kind] of sample.turns) {
      const turn = element("div", `turn ${kind}`);
      turn.dataset.start = start;
      turn.dataset.end = end;
      turn.append(element("span", "turn-label", kind === "policy" ? `turn ${++policyTurns}` : "observation"));
      for (let i = start; i < end; i++) turn.append(tokenSpan(sample, i));
      tokens.append(turn);
    }
  } else {
    sample.tokens.forEach((_, i) => tokens.append(tokenSpan(sample, i)));
  }
  response.append(element("span", "label", "response"), tokens);
  node.append(meta, prompt, response);
  return node;
}

function tokenSpan(sample, i) {
  const token = sample.tokens[i];
  const special = /^<\|?[^<>]+\|?>$/.test(token) || token === "";
  const span = element("span", special ? "token special" : "token", token === "" ? "\u25af" : token);
  if (sample.policy[i]) span.style.backgroundColor = tokenColour(sample, i);
  else span.classList.add("observation");
  span.title = tokenTitle(sample, i);
  return span;
}

function selected() {
  const picked = DATA.samples.filter((s) => state.iteration === "all" || String(s.iteration) === state.iteration);
  if (state.order === "reward_low") picked.sort((a, b) => a.reward - b.reward || a.line - b.line);
  const kl = (s) => s.meanKl ?? -Infinity;  // a sample without KL goes last
  if (state.order === "kl_high") picked.sort((a, b) => kl(b) - kl(a) || a.line - b.line);
  return picked;
}

function render() {
  const picked = selected();
  const list = document.getElementById("samples");
  list.replaceChildren(...picked.slice(0, state.shown).map(card));
  if (!picked.length) {
    list.append(element("p", "empty", DATA.samples.length ? "no samples in this iteration" :
      `no samples logged in ${DATA.file} (samples_log.per_minibatch: 0, or no iteration trained yet)`));
  }
  const more = document.getElementById("more");
  more.hidden = picked.length <= state.shown;
  more.textContent = `show ${Math.min(PAGE, picked.length - state.shown)} more of ${picked.length - state.shown}`;
  legend();
}

function header() {
  document.getElementById("title").textContent = `Samples of run ${DATA.run}`;
  const iterations = [...new Set(DATA.samples.map((s) => s.iteration))].sort((a, b) => a - b);
  document.getElementById("counts").textContent =
    `${DATA.samples.length} samples from ${iterations.length} iterations in ${DATA.file}; ` +
    "hover a token for its values";
  const skipped = document.getElementById("skipped");
  document.getElementById("skipped-summary").textContent =
    `${DATA.skipped.length} line${DATA.skipped.length === 1 ? "" : "s"} of ${DATA.file} skipped` +
    (DATA.skipped.length ? ` (lines ${DATA.skipped.map((s) => s.line).join(", ")})` : "");
  skipped.classList.toggle("bad", DATA.skipped.length > 0);
  document.getElementById("skipped-lines").replaceChildren(
    ...DATA.skipped.map((s) => element("li", "", `line ${s.line}: ${s.reason}`)));
  const select = document.getElementById("iteration");
  const all = element("option", "", `all (${DATA.samples.length} samples)`);
  all.value = "all";
  select.append(all, ...iterations.map((i) => {
    const own = DATA.samples.filter((s) => s.iteration === i);
    const reward = fmt(mean(own.map((s) => s.reward)));
    const option = element("option", "", `${i} · ${own.length} samples · mean reward ${reward}`);
    option.value = String(i);
    return option;
  }));
  const klInput = document.querySelector('input[name="colour"][value="kl"]');
  klInput.disabled = DATA.samples.every((s) => !s.kl);
  klInput.parentElement.title = klInput.disabled ? "this run has no reference model: no KL" : "";
}

function plots() {
  const list = document.getElementById("plot-list");
  if (!DATA.plots.length) {
    list.append(element("p", "empty", "no plots yet: a run draws them in plots/ when it finishes"));
  }
  for (const plot of DATA.plots) {
    const figure = element("figure");
    const link = element("a");
    link.href = plot.name;
    const img = element("img");
    img.src = plot.src;
    img.alt = plot.name;
    link.append(img);
    figure.append(link, element("figcaption", "", plot.name));
    list.append(figure);
  }
}

header();
plots();
render();
document.getElementById("iteration").addEventListener("change", (e) => {
  state.iteration = e.target.value;
  state.shown = PAGE;
  render();
});
document.getElementById("order").addEventListener("change", (e) => {
  state.order = e.target.value;
  state.shown = PAGE;
  render();
});
document.getElementById("colour-by").addEventListener("change", (e) => {
  state.colour = e.target.value;
  render();
});
document.getElementById("more").addEventListener("click", () => {
  state.shown += PAGE;
  render();
});
