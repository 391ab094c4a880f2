// segfuse web view: streams /v1/chat/completions and colours each segment by its author.
// Plain JS, no build step, no external resources (the page must work offline).
// The fusion control (mode, margin, members) lives in the query string, so a view can be shared.
"use strict";

// Okabe–Ito colours: distinguishable with the common colour-vision deficiencies.
const PALETTE = ["#E69F00", "#56B4E9", "#009E73", "#CC79A7", "#0072B2", "#D55E00", "#F0E442"];

const $ = (id) => document.getElementById(id);
const state = { model: "segfuse", members: [], ensembles: [], history: [], controller: null, asked: null, problems: [] };

function colour(name) {
  const i = state.members.indexOf(name);
  return PALETTE[(i < 0 ? state.members.length : i) % PALETTE.length];
}

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (key === "style") Object.assign(node.style, value);
    else if (key.startsWith("--")) node.style.setProperty(key, value);
    else if (key === "dataset") Object.assign(node.dataset, value);
    else node[key] = value;
  }
  for (const child of children) node.append(child);
  return node;
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

function setStatus(text, isError = false) {
  $("status").textContent = text;
  $("status").classList.toggle("error", isError);
}

async function loadModels() {
  try {
    const response = await fetch("v1/models", { headers: headers() });
    const body = await response.json();
    if (!response.ok) throw new Error(body.error ? body.error.message : response.statusText);
    // Every ensemble the server serves, the first being the server's default (the URL's ?model= picks one).
    state.ensembles = body.data.filter((m) => Array.isArray(m.members) && m.members.length);
    const wanted = state.ensembles.find((m) => m.id === fromURL().model);
    if (fromURL().model && !wanted) state.problems.push(`no ensemble named "${fromURL().model}"`);
    $("model").replaceChildren(...state.ensembles.map((m) => el("option", { value: m.id, textContent: m.id })));
    $("model-label").hidden = state.ensembles.length < 2;
    pickEnsemble(wanted || state.ensembles[0], body.data);
  } catch (err) {
    setStatus(`cannot list models: ${err.message}`, true);
  }
}

// One ensemble's members as the legend (none listed: every model is a member of the one ensemble).
function pickEnsemble(ensemble, models = [], fresh = false) {
  if (fresh) {  // the user picked another ensemble: all its members take part, whatever was ticked before
    $("legend").replaceChildren();
    state.asked = null;
  }
  state.model = ensemble ? ensemble.id : models[0].id;
  state.members = ensemble ? ensemble.members : models.map((m) => m.id);
  if (ensemble) $("model").value = ensemble.id;
  showMembers();
  const loading = ensemble && ensemble.loaded === false ? " (not loaded yet: the first request loads them)" : "";
  setStatus(`${state.members.length} members${loading || " ready"}`);
}

// ---------------------------------------------------------------- the fusion control, kept in the URL

// What each mode sends as the request's `segfuse` options (consult: the margin input's accept_margin).
const MODES = {
  leader: { name: "leader alone", options: () => (draft() === "off" ? {} : { draft: draft() }) },  // the defaults
  consult: { name: "consulting", options: () => ({ accept_margin: margin() }) },
  plain: { name: "plain fusion", options: () => ({ gate: null, accept_margin: null }) },
};

// The control as the URL asks for it: ?mode=leader|consult|plain&margin=NATS&members=a,b (absent: all).
function fromURL() {
  const query = new URLSearchParams(location.search);
  const members = (query.get("members") || "").split(",").map((m) => m.trim()).filter(Boolean);
  return { mode: query.get("mode"), margin: query.get("margin"), members: members.length ? members : null,
    model: query.get("model"), draft: query.get("draft") };
}

function applyURL() {
  const asked = fromURL();
  const problems = [];
  if (asked.mode && !MODES[asked.mode]) problems.push(`unknown mode "${asked.mode}" (leader, consult or plain)`);
  const radio = document.querySelector(`input[name=mode][value="${MODES[asked.mode] ? asked.mode : "leader"}"]`);
  radio.checked = true;
  if (asked.margin !== null) {
    if (Number(asked.margin) > 0) $("margin").value = asked.margin;
    else problems.push(`margin must be a number above 0, not "${asked.margin}"`);
  }
  if (asked.draft !== null) {
    if (["off", "members", "lookup", "auto"].includes(asked.draft)) $("draft").value = asked.draft;
    else problems.push(`draft must be off, members, lookup or auto, not "${asked.draft}"`);
  }
  state.asked = asked.members;  // checked against the members once they are listed
  state.problems = problems;
}

function mode() {
  return document.querySelector("input[name=mode]:checked").value;
}

function margin() {
  return Number($("margin").value);
}

function draft() {
  return $("draft").value;
}

function chosen() {
  return Array.from(document.querySelectorAll("#legend input:checked"), (box) => box.value);
}

// The members as a legend of their colours and a checkbox each (the URL's choice, else all of them).
function showMembers() {
  const before = document.querySelectorAll("#legend input").length ? chosen() : state.asked;
  const unknown = (before || []).filter((m) => !state.members.includes(m));
  const picked = (before || []).filter((m) => state.members.includes(m));
  if (unknown.length) state.problems.push(`no member named ${unknown.join(", ")}`);
  $("legend").replaceChildren(...state.members.map((name) => el("label", { className: "member", dataset: { member: name } },
    el("input", { type: "checkbox", value: name, checked: !picked.length || picked.includes(name) }),
    el("span", { className: "swatch", style: { background: colour(name) } }), name,
    el("small", { className: "memory" }))));
  updateFusion();
  showMemory();
}

// One word for a model's state from its members' places, as the server's model state says it:
// loading, loaded (answering), idle (loaded, nothing answering), partly loaded, unloaded, ...
function modelWord(members, memory) {
  const places = members.map((m) => memory[m]).filter(Boolean);
  if (!places.length) return "";
  const states = new Set(places.map((p) => p.state));
  for (const word of ["failed", "loading", "unloading"]) if (states.has(word)) return word;
  if (states.size === 1 && states.has("loaded")) return places.some((p) => p.in_use) ? "loaded" : "idle";
  return states.has("loaded") ? "partly loaded" : "unloaded";
}

// Each model's state in the picker, and the picked one's beside its Load and Free buttons.
function showModels(memory) {
  for (const option of $("model").options) {
    const ensemble = state.ensembles.find((m) => m.id === option.value);
    const word = ensemble ? modelWord(ensemble.members, memory) : "";
    option.textContent = word ? `${option.value} (${word})` : option.value;
  }
  const word = modelWord(state.members, memory);
  const pinned = state.members.every((m) => memory[m] && memory[m].pinned);
  $("model-memory").hidden = !word;
  $("model-state").textContent = `${word}${pinned && word !== "unloaded" ? ", pinned" : ""}`;
  $("model-state").dataset.state = word;
}

// Load or free the picked model now, without a generation (POST v1/models/{id}/load or /unload).
async function modelAction(action) {
  const model = state.model;
  setStatus(`${action === "load" ? "loading" : "freeing"} ${model}…`);
  const watching = setInterval(showMemory, 1000);  // the members' places while it works
  try {
    const response = await fetch(`v1/models/${model}/${action}`, { method: "POST", headers: headers() });
    const body = await response.json();
    if (!response.ok) throw new Error(body.error ? body.error.message : response.statusText);
    setStatus(`${model}: ${body.state}`);
  } catch (err) {
    setStatus(`could not ${action === "load" ? "load" : "free"} ${model}: ${err.message}`, true);
  } finally {
    clearInterval(watching);
    showMemory();
  }
}

// Each member's place in memory, from /health (the key's holders see it): loaded, loading, or not yet;
// when an idle one will be freed.
async function showMemory() {
  try {
    const response = await fetch("health", { headers: headers() });
    const memory = (await response.json()).memory || {};
    showModels(memory);
    for (const label of document.querySelectorAll("#legend .member")) {
      const place = memory[label.dataset.member];
      if (!place) continue;
      const words = { loaded: "", loading: ` loading ${place.loading_s}s`, unloaded: " not loaded",
        unloading: " freeing", failed: " failed" }[place.state];
      const frees = place.state === "loaded" && place.expires_in_s !== null ? ` frees in ${Math.ceil(place.expires_in_s)}s` : "";
      label.querySelector(".memory").textContent = words + frees;
      label.title = place.error || `${place.state}${place.in_use ? `, in use by ${place.in_use}` : ""}${frees}`;
    }
  } catch (err) {
    // /health is a courtesy here: the page works without it.
  }
}

// What the control asks of the API: `model` (the ensemble, or one member answering alone) and the
// `segfuse` options; or why it cannot be asked. The API fuses every member or lets one answer alone.
function fusion() {
  const members = chosen(), current = mode();
  if (!state.members.length) return { model: state.model, options: MODES[current].options(), label: "ensemble" };
  if (!members.length) return { error: "Tick at least one member." };
  if (members.length === 1 && state.members.length > 1) {
    return { model: members[0], options: {}, label: `${members[0]} alone`,
      note: `${members[0]} answers alone (model "${members[0]}"): the mode does not apply.` };
  }
  if (members.length < state.members.length) {
    return { error: "Tick all members or one: the API fuses every member of an ensemble, or lets one answer alone " +
      `(to fuse only ${members.join(" and ")}, declare an ensemble of them: segfuse serve --ensemble NAME=${members.join(",")}).` };
  }
  if (current === "consult" && !(margin() > 0)) return { error: "The margin must be a number of nats above 0." };
  const drafting = { members: "the others draft for it", lookup: "it reads drafts copied from the prompt and its answer",
    auto: "it reads the drafts that pay on this machine" }[draft()];
  const notes = {
    leader: drafting ? `The leader (the largest member) answers alone, and ${drafting}: the same answer, in fewer passes.`
      : "The server's defaults: the leader (the largest member) answers alone; the others are not asked.",
    consult: `Where the leader is unsure, the others propose segments; it accepts those within ${margin()} nats of its own choices, and they go to a vote with its own.`,
    plain: "No leader: every member drafts each round, every member scores every draft, and the best scored wins.",
  };
  return { model: state.model, options: MODES[current].options(), label: `ensemble · ${MODES[current].name}`, note: notes[current] };
}

function updateFusion() {
  const asked = fusion();
  $("margin").disabled = mode() !== "consult";
  $("draft").disabled = mode() !== "leader";
  const note = [...state.problems, asked.error || asked.note].join(" · ");
  $("fusion-note").textContent = note;
  $("fusion-note").classList.toggle("error", Boolean(asked.error));
  $("send").disabled = Boolean(state.controller) || Boolean(asked.error);
}

// The URL says what the control says (defaults left out), replacing the history entry: a link to share.
function writeURL() {
  const query = new URLSearchParams(location.search);
  const current = mode(), members = chosen();
  if (current === "leader") query.delete("mode"); else query.set("mode", current);
  if (current === "consult") query.set("margin", $("margin").value); else query.delete("margin");
  if (current === "leader" && draft() !== "off") query.set("draft", draft()); else query.delete("draft");
  if (members.length === state.members.length) query.delete("members"); else query.set("members", members.join(","));
  if (state.ensembles.length < 2 || state.model === state.ensembles[0].id) query.delete("model");
  else query.set("model", state.model);
  const search = query.toString().replace(/%2C/g, ",");  // commas are fine in a query, and easier to read
  history.replaceState(null, "", `${location.pathname}${search ? `?${search}` : ""}${location.hash}`);
}

function onFusionChange() {
  state.problems = [];  // the user has moved on from what the URL asked
  updateFusion();
  writeURL();
}

// ---------------------------------------------------------------- the round's candidates (hover, and the list)

function fmt(x) {
  return typeof x === "number" ? x.toFixed(3) : "–";
}

function shown(candidate) {
  if (candidate.text === "") return candidate.finished ? "⏹ (stop here)" : "∅ (no usable draft)";
  // Newlines as visible marks keep the table compact and show what the member really wrote.
  return candidate.text.replace(/\n/g, "↵") + (candidate.finished ? " ⏹" : "");
}

// How a round's winner was decided (RoundRecord.decision).
const DECISIONS = {
  confident: "alone: the leader was confident",
  alone: "alone: the leader answers alone",
  rejected: "the leader accepted no proposal",
  vote: "put to a vote",
};

// A round as a caption (who won, how it was decided) and a table of its candidates and their scores.
function roundView(round) {
  const verifiers = Object.keys(round.scores);
  const head = el("tr", {}, el("th", { textContent: "member" }), el("th", { className: "text", textContent: "candidate" }),
    el("th", { textContent: "total" }), ...verifiers.map((v) => el("th", { textContent: `by ${v}`, title: "normalised score from this verifier" })));
  const rows = round.candidates.map((cand, i) => el("tr", { className: i === round.winner_index ? "won" : "" },
    el("td", {}, el("span", { className: "swatch", style: { background: colour(cand.model) } }), cand.model, i === round.winner_index ? " ✓" : ""),
    el("td", { className: "text", textContent: shown(cand) +
      (round.penalised && round.penalised[cand.model] ? ` (held back: ${round.penalised[cand.model]})` : "") +
      (round.consulted && round.consulted[cand.model] ? ` (the leader ${round.consulted[cand.model]})` : "") }),
    el("td", { textContent: fmt(round.aggregate[i]) }),
    ...verifiers.map((v) => el("td", { textContent: fmt(round.scores[v][i]) }))));
  // Weights are worth showing only once Hedge has moved them off uniform.
  const values = round.weights ? Object.values(round.weights) : [];
  const moved = values.some((w) => Math.abs(w - values[0]) > 1e-9);
  const weights = moved ? Object.entries(round.weights).map(([m, w]) => `${m} ${w.toFixed(2)}`).join(", ") : "";
  const how = DECISIONS[round.decision] || round.decision;
  return [
    el("div", { className: "caption", textContent: `round ${round.index} · won by ${round.winner} · ${how}` +
      (round.leader ? ` (leader ${round.leader}, confidence ${fmt(round.confidence)})` : "") + (weights ? ` · weights: ${weights}` : "") }),
    el("table", {}, el("thead", {}, head), el("tbody", {}, ...rows)),
  ];
}

function showRound(span, round) {
  const tip = $("tip");
  tip.replaceChildren(...roundView(round));
  tip.hidden = false;
  const box = span.getBoundingClientRect();
  const width = tip.offsetWidth, height = tip.offsetHeight;
  const left = Math.min(Math.max(8, box.left), window.innerWidth - width - 8);
  const below = box.bottom + 6 + height < window.innerHeight;
  tip.style.left = `${left}px`;
  tip.style.top = `${below ? box.bottom + 6 : Math.max(8, box.top - height - 6)}px`;
}

function hideRound() {
  $("tip").hidden = true;
}

// ---------------------------------------------------------------- one answer

class Answer {
  constructor(label) {
    this.text = "";
    this.open = null;  // the span of a segment still being written
    this.wins = new Map();
    this.body = el("div", { className: "answer waiting" });
    this.summary = el("div", { className: "summary" });
    this.meta = el("div", { className: "meta" });
    this.roundList = el("ol");
    this.rounds = el("details", { className: "rounds" }, el("summary", { textContent: "rounds" }), this.roundList);
    this.node = el("section", { className: "turn assistant" }, el("div", { className: "who", textContent: label }),
      this.body, this.summary, this.rounds, this.meta);
    $("log").append(this.node);
  }

  // A piece of the answer: a whole segment with its round, or (the leader answering alone) a piece of
  // a segment still being written, which joins its round's span until the round's record comes.
  segment(text, model, index, round) {
    this.body.classList.remove("waiting");
    this.text += text;
    const key = String(index || (round ? round.index : ""));
    let span = this.open;
    if (!span || !key || span.dataset.round !== key) {
      this.wins.set(model, (this.wins.get(model) || 0) + 1);
      span = el("span", { className: "seg", textContent: "", tabIndex: 0, "--c": colour(model),
        dataset: { model, round: key } });
      this.body.append(span);
    }
    span.textContent += text;
    this.open = round ? null : span;
    if (round) this.record(round, span);
    this.node.scrollIntoView({ block: "end" });
  }

  // A round's record that came after its pieces, in a chunk of its own: the open span's hover.
  round(round) {
    const span = this.open;
    if (span && span.dataset.round === String(round.index)) this.open = null;
    this.record(round, span && span.dataset.round === String(round.index) ? span : null);  // no span: "stop here"
  }

  // A round's record: its segment's hover, and an entry in the answer's list of rounds.
  record(round, span) {
    if (span) {
      span.addEventListener("mouseenter", () => showRound(span, round));
      span.addEventListener("focus", () => showRound(span, round));
      span.addEventListener("mouseleave", hideRound);
      span.addEventListener("blur", hideRound);
    }
    this.roundList.append(el("li", { dataset: { winner: round.winner, decision: round.decision } }, ...roundView(round)));
    const n = this.roundList.children.length;
    this.rounds.firstChild.textContent = `${n} round${n === 1 ? "" : "s"}: who drafted what, the scores, who won`;
  }

  // A structured answer, indented, below the segments (which keep showing who wrote what).
  formatted() {
    const text = this.text.trim();
    if (!text.startsWith("{") && !text.startsWith("[")) return;
    try {
      const value = JSON.parse(text);
      this.summary.append(el("pre", { className: "json", textContent: JSON.stringify(value, null, 2) }));
    } catch (err) {
      // not (yet) JSON: the segments say it all
    }
  }

  bars(title, values, format) {
    const top = Math.max(...values.map(([, v]) => v), 1e-9);
    this.summary.append(el("div", { className: "title", textContent: title }));
    for (const [name, value] of values) {
      this.summary.append(
        el("span", { className: "name" }, el("span", { className: "swatch", style: { background: colour(name) } }), name),
        el("span", { className: "bar-wrap" },
          el("span", { className: "bar", "--c": colour(name), style: { width: `${(12 * value) / top}rem` } }),
          el("span", { textContent: format(value) })));
    }
  }

  finish(info, finishReason, hedge) {
    this.body.classList.remove("waiting");
    const members = (info && info.members) || state.members;
    this.summary.replaceChildren();
    this.bars("segments won", members.map((m) => [m, this.wins.get(m) || 0]), (v) => String(v));
    this.formatted();
    if (hedge && info && info.weights) this.bars("Hedge weights at the end", members.map((m) => [m, info.weights[m] || 0]), (v) => v.toFixed(2));
    if (info && info.stats) {
      const s = info.stats;
      this.meta.textContent = `${s.rounds} round${s.rounds === 1 ? "" : "s"} · ${s.tokens} tokens · ${s.total_s.toFixed(1)} s` +
        (s.queue_s > 0.05 ? ` (+${s.queue_s.toFixed(1)} s queued)` : "") + ` · finish: ${finishReason}`;
    }
    this.node.scrollIntoView({ block: "end" });
  }

  usage(usage) {
    this.meta.textContent += ` · usage: ${usage.prompt_tokens} prompt + ${usage.completion_tokens} completion tokens`;
  }

  error(message) {
    this.body.classList.remove("waiting");
    this.body.append(el("div", { className: "error-text", textContent: `error: ${message}` }));
  }
}

// ---------------------------------------------------------------- streaming

async function* sseEvents(response, onComment = () => {}) {
  // Server-sent events over fetch (EventSource cannot POST): yield each `data:` payload; comment lines
  // (`: loading qwen2.5-coder-0.5b`, while the model's members load) go to onComment.
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      frame.split("\n").filter((l) => l.startsWith(":")).forEach((l) => onComment(l.slice(1).trim()));
      const data = frame.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (data) yield data;
    }
  }
}

async function ask(question) {
  state.history.push({ role: "user", content: question });
  $("log").append(el("section", { className: "turn user" }, el("div", { className: "who", textContent: "you" }), question));
  const asked = fusion();
  const answer = new Answer(asked.label);
  const hedge = $("hedge").checked;
  const body = {
    model: asked.model,
    messages: state.history,
    stream: true,
    stream_options: { include_usage: true },
    max_tokens: Number($("max-tokens").value) || 96,
    temperature: Number($("temperature").value),
  };
  const options = { ...asked.options, ...(hedge ? { hedge: true } : {}) };
  if (Object.keys(options).length) body.segfuse = options;
  if ($("json").checked) body.response_format = { type: "json_object" };
  state.controller = new AbortController();
  busy(true);
  setStatus("generating…");
  let finished = false;
  try {
    const response = await fetch("v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: state.controller.signal,
    });
    if (!response.ok) {
      const err = await response.json().catch(() => ({}));
      throw new Error(err.error ? err.error.message : `${response.status} ${response.statusText}`);
    }
    const loading = (text) => { if (text.startsWith("loading ")) setStatus(`${text} …`); };
    let first = true;
    for await (const data of sseEvents(response, loading)) {
      if (first) setStatus("generating…");
      first = false;
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) answer.usage(chunk.usage);
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      const info = chunk.segfuse || {};
      if (choice.delta && choice.delta.content) {
        answer.segment(choice.delta.content, info.segment ? info.segment.model : state.model,
          info.segment ? info.segment.round : null, info.round);
      } else if (info.round) {
        answer.round(info.round);
      }
      if (choice.finish_reason) {
        answer.finish(info, choice.finish_reason, hedge);
        finished = true;
      }
    }
    state.history.push({ role: "assistant", content: answer.text });
    setStatus(finished ? "done" : "the stream ended early");
  } catch (err) {
    state.history.pop();  // the question stays on screen but not in the context
    if (err.name === "AbortError") {
      answer.error("stopped");
      setStatus("stopped");
    } else {
      answer.error(err.message);
      setStatus(err.message, true);
    }
  } finally {
    state.controller = null;
    busy(false);
    showMemory();
  }
}

function busy(on) {
  $("stop").disabled = !on;
  document.body.dataset.busy = on ? "1" : "";
  updateFusion();  // Send: off while busy, or while the control asks for what the API cannot do
}

$("ask").addEventListener("submit", (event) => {
  event.preventDefault();
  const question = $("prompt").value.trim();
  if (!question || state.controller || fusion().error) return;
  $("prompt").value = "";
  ask(question);
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("ask").requestSubmit();
  }
});
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
$("clear").addEventListener("click", () => {
  if (state.controller) state.controller.abort();
  state.history = [];
  $("log").replaceChildren();
  hideRound();
});
$("api-key").addEventListener("change", () => {
  localStorage.setItem("segfuse-api-key", $("api-key").value);
  loadModels();
});
$("model").addEventListener("change", () => pickEnsemble(state.ensembles.find((m) => m.id === $("model").value), [], true));
$("load-model").addEventListener("click", () => modelAction("load"));
$("free-model").addEventListener("click", () => modelAction("unload"));
$("fusion").addEventListener("change", onFusionChange);
$("margin").addEventListener("input", onFusionChange);
$("api-key").value = localStorage.getItem("segfuse-api-key") || "";
applyURL();
updateFusion();
loadModels();
