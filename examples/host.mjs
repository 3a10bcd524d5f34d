// A Node host for mtp-runner, with no dependencies: spawn the runner, write one JSON request
// per line to its stdin, read one JSON frame per line from its stdout.
//
//   node examples/host.mjs --model path/to/model.gguf --prompt "Why is the sky blue?"
//
// Flags: --model PATH, --prompt TEXT, --num-predict N, --temperature T, --python EXE,
// --format json|SCHEMA (constrain the answer to JSON, or to a JSON Schema given as JSON text).
// Anything after `--` goes to the runner unchanged.
//
// The runner it starts, first found: `--python EXE` (EXE -m runner); $MTP_RUNNER_CMD, a
// command line split at spaces and used as is (another runner, or this one with its own flags);
// this repository's .venv (.venv/bin/python, or .venv\Scripts\python.exe on Windows), found
// from this file's location, so it works from any directory after ./scripts/bootstrap.sh;
// else python3 on the PATH (which needs the package and its dependencies installed).

import { spawn } from "node:child_process";
import { existsSync } from "node:fs";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";

const REPO = new URL("..", import.meta.url);
const VENV_PYTHONS = [".venv/bin/python", ".venv/Scripts/python.exe"];

// [executable, ...arguments] that start the runner (see the top of this file).
function runnerCommand(args) {
  const own = (python) => [python, "-m", "runner", "--log-level", "warning"];
  if (args.python) return own(args.python);
  if (process.env.MTP_RUNNER_CMD) return process.env.MTP_RUNNER_CMD.trim().split(/\s+/);
  for (const relative of VENV_PYTHONS) {
    const python = fileURLToPath(new URL(relative, REPO));
    if (existsSync(python)) return own(python);
  }
  return own("python3");
}

function parseArgs(argv) {
  const args = { prompt: "What is the capital of France? Answer in one sentence.", numPredict: 256 };
  const dash = argv.indexOf("--");
  args.runnerArgs = dash >= 0 ? argv.slice(dash + 1) : [];
  const own = dash >= 0 ? argv.slice(0, dash) : argv;
  for (let i = 0; i < own.length; i += 2) {
    const [flag, value] = [own[i], own[i + 1]];
    if (value === undefined) throw new Error(`${flag} needs a value`);
    if (flag === "--model") args.model = value;
    else if (flag === "--prompt") args.prompt = value;
    else if (flag === "--num-predict") args.numPredict = Number(value);
    else if (flag === "--temperature") args.temperature = Number(value);
    else if (flag === "--python") args.python = value;
    else if (flag === "--format") args.format = value === "json" ? "json" : JSON.parse(value);
    else throw new Error(`unknown flag ${flag}`);
  }
  return args;
}

const chatml = (question) =>
  `<|im_start|>user\n${question}<|im_end|>\n<|im_start|>assistant\n`;

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const [command, ...runnerArgs] = runnerCommand(args);
  runnerArgs.push(...args.runnerArgs);
  if (args.model) runnerArgs.push("--model", args.model);
  process.stderr.write(`runner: ${[command, ...runnerArgs].join(" ")}\n`);

  // Logs (stderr) pass straight through; stdout carries nothing but frames.
  const child = spawn(command, runnerArgs, { stdio: ["pipe", "pipe", "inherit"] });
  const exited = new Promise((resolve) => {
    child.on("exit", (code) => resolve(code ?? 1));
    child.on("error", (err) => {
      // Not started (no such executable): stdout closes without frames, and this ends the run.
      process.stderr.write(`could not start the runner ${command}: ${err.message}\n`);
      resolve(1);
    });
  });
  const send = (request) => child.stdin.write(JSON.stringify(request) + "\n");

  const options = { num_predict: args.numPredict };
  if (args.temperature !== undefined) options.temperature = args.temperature;

  let failed = false;
  let ready = false;
  for await (const line of createInterface({ input: child.stdout })) {
    const frame = JSON.parse(line);
    if (frame.type === "progress") {
      process.stderr.write(`loading: ${frame.stage} ${frame.done}/${frame.total}\n`);
    } else if (frame.type === "ready") {
      ready = true;
      process.stderr.write(`model ${frame.model} ready (MTP: ${frame.mtp_detail})\n`);
      const request = { type: "completion", id: "host-1", prompt: chatml(args.prompt), options };
      if (args.format !== undefined) request.format = args.format;
      send(request);
    } else if (frame.type === "token" && frame.id === "host-1") {
      process.stdout.write(frame.content);
    } else if (frame.type === "error") {
      process.stderr.write(`\n[error ${frame.code}] ${frame.message}\n`);
      failed = true; // a load failure (id null) also ends the runner, and with it this loop
    } else if (frame.type === "done" && frame.id === "host-1") {
      const seconds = frame.eval_ns / 1e9;
      const rate = seconds > 0 ? frame.eval_tokens / seconds : 0;
      const spec = frame.speculation;
      process.stdout.write(
        `\n--- ${frame.done_reason}: ${frame.eval_tokens} tokens in ${seconds.toFixed(2)} s ` +
          `(${rate.toFixed(1)} tokens/s)\n` +
          `prompt: ${frame.prompt_tokens} tokens, ${frame.prompt_cached_tokens} from the prefix cache\n` +
          `speculation: ${spec.rounds} rounds, ${spec.accepted}/${spec.drafted} drafts accepted\n`,
      );
      failed ||= frame.done_reason === "error";
      child.stdin.end(); // end of input: the runner finishes and exits 0
    }
  }
  const code = await exited;
  if (!ready) process.stderr.write(`the runner exited (code ${code}) before it was ready\n`);
  process.exitCode = failed || code !== 0 ? 1 : 0;
}

main().catch((err) => {
  process.stderr.write(`${err.stack ?? err}\n`);
  process.exitCode = 1;
});
