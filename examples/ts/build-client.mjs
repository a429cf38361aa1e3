// `npm run build` runs this first (`prebuild`): it builds the client this example depends on
// (packages/ts, linked by `file:`), so `npm ci && npm run build` works from a fresh checkout.
// The first time it installs the client's dev dependencies (its `tsc`) from its lockfile.
import { execFileSync } from "node:child_process";
import { existsSync } from "node:fs";
import { fileURLToPath } from "node:url";

const client = fileURLToPath(new URL("../../packages/ts/", import.meta.url));
const npm = (...args) =>
  execFileSync("npm", args, { cwd: client, stdio: "inherit", shell: process.platform === "win32" });
if (!existsSync(`${client}/node_modules/.package-lock.json`)) npm("ci", "--no-audit", "--no-fund");
npm("run", "build");
