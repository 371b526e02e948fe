// Strict offline validation of custom resources (Gateway API, Prometheus Operator) against their published
// models, for tests/test_k8s_components.py:
//
//   node validate.mjs docs.json      # a JSON list of rendered documents -> a JSON list of problems on stdout
//
// Two checks per document, as a cluster's strict validation would make them: the kubernetes-models
// validator (types, enums, patterns, required fields, generated from the projects' Go API types), and
// the TypeScript compiler on the document as a literal of the model's interface, whose excess-property
// check refuses every field the API does not have (the validators alone let unknown fields through).

import { readFileSync, rmSync, writeFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import ts from "typescript";

const HERE = dirname(fileURLToPath(import.meta.url));
const PACKAGES = {
  "gateway.networking.k8s.io": "@kubernetes-models/gateway-api",
  "monitoring.coreos.com": "@kubernetes-models/prometheus-operator",
};

const docs = JSON.parse(readFileSync(process.argv[2], "utf8"));
const problems = [];
const typed = [];
for (const [i, doc] of docs.entries()) {
  const where = `${doc.kind}/${doc.metadata?.name}`;
  const pkg = PACKAGES[String(doc.apiVersion).split("/")[0]];
  if (!pkg) {
    problems.push(`${where}: no schema for ${doc.apiVersion}`);
    continue;
  }
  const module = `${pkg}/${doc.apiVersion}/${doc.kind}`;
  let Model;
  try {
    Model = (await import(module))[doc.kind];
  } catch (e) {
    problems.push(`${where}: ${doc.apiVersion} ${doc.kind} is not a kind of ${pkg}`);
    continue;
  }
  try {
    new Model(doc).validate();
  } catch (e) {
    problems.push(`${where}: ${String(e.message).split("\n").slice(0, 4).join("; ")}`);
  }
  typed.push({ i, where, module });
}

// One file, one typed literal per document; a diagnostic's line says which document it is about.
const lines = typed.map((t, n) => `import type { I${docs[t.i].kind} as T${n} } from "${t.module}";`);
const firstLine = lines.length;
typed.forEach((t, n) => lines.push(`export const d${n}: T${n} = ${JSON.stringify(docs[t.i])};`));
const file = join(HERE, `.check-${process.pid}.ts`);
writeFileSync(file, lines.join("\n") + "\n");
try {
  const program = ts.createProgram([file], {
    noEmit: true, strict: true, skipLibCheck: true, target: ts.ScriptTarget.ES2022,
    module: ts.ModuleKind.NodeNext, moduleResolution: ts.ModuleResolutionKind.NodeNext,
  });
  for (const d of ts.getPreEmitDiagnostics(program)) {
    const text = ts.flattenDiagnosticMessageText(d.messageText, "; ");
    const line = d.file && d.start !== undefined ? d.file.getLineAndCharacterOfPosition(d.start).line : -1;
    const t = typed[line - firstLine];
    problems.push(`${t ? t.where : "typecheck"}: ${text}`);
  }
} finally {
  rmSync(file, { force: true });
}
process.stdout.write(JSON.stringify(problems) + "\n");
