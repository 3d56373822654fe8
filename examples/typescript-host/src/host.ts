// A host in TypeScript: each step writes the host's own state and its export intent in ONE
// transaction, through the relay's SQL write API (`relay_open_run`, `relay_append`,
// `relay_rewind`, `relay_close_run`). Nothing here knows the relay's tables or its lock
// protocol: the functions carry every rule, and refuse bad calls with documented SQLSTATEs
// (RL100..RL112).
//
//   DATABASE_URL=postgres://postgres@127.0.0.1:5432/test TENANT=acme RUNS=2 STEPS=20 FORK=12 \
//     RETRY_STEPS=8 node dist/host.js
//
// Each run writes steps 1..STEPS on branch `main`, then rewinds to step FORK on branch `retry`
// (the agent retries from there) and writes steps FORK+1..FORK+RETRY_STEPS on it. Live history
// is therefore `main` 1..FORK, then `retry` FORK+1..FORK+RETRY_STEPS.
import pg from "pg";

function setting(name: string, fallback?: string): string {
  const value = process.env[name] ?? fallback;
  if (value === undefined) {
    console.error(`${name} is not set`);
    process.exit(2);
  }
  return value;
}

function count(name: string, fallback: string): number {
  const value = Number(setting(name, fallback));
  if (!Number.isInteger(value) || value < 0) {
    console.error(`${name} must be a whole number, got ${process.env[name]}`);
    process.exit(2);
  }
  return value;
}

const tenant = setting("TENANT", "acme");
const runs = count("RUNS", "2");
const steps = count("STEPS", "20");
const fork = count("FORK", "12");
const retrySteps = count("RETRY_STEPS", "8");
// The relay's schema (RELAY_SCHEMA), if it has one: the functions are named in it, and they
// find their tables themselves, whatever this connection's search_path is.
const schema = process.env.RELAY_SCHEMA ?? "";
if (schema !== "" && !/^[a-z_][a-z0-9_]{0,62}$/.test(schema)) {
  console.error(`RELAY_SCHEMA must be a lowercase identifier, got ${schema}`);
  process.exit(2);
}
const fn = (name: string) => (schema === "" ? name : `${schema}.${name}`);

/** The payload of a step: what consumers receive as the message body. */
const payload = (run: string, branch: string, step: number) =>
  Buffer.from(JSON.stringify({ run, branch, step }));

async function inTransaction<T>(client: pg.PoolClient, work: () => Promise<T>): Promise<T> {
  await client.query("BEGIN");
  try {
    const result = await work();
    await client.query("COMMIT");
    return result;
  } catch (error) {
    await client.query("ROLLBACK");
    throw error;
  }
}

/**
 * The intent's metadata (wire version 3, `store::Metadata`'s JSON): what the event is, its
 * media type, the request it belongs to, what caused it, a header of the host's own and the
 * W3C trace context of the step. `relay_append` validates it (RL112) and the relay ships it
 * as AMQP properties and headers.
 */
const metadata = (run: string, branch: string, step: number) => ({
  type: "agent.step",
  content_type: "application/json",
  correlation_id: `${run}-${step}`,
  causation_id: `${branch}-${step - 1}`,
  headers: { "agent-step": String(step) },
  traceparent: `00-${(0x1000 + step).toString(16).padStart(32, "0")}-${(step + 1).toString(16).padStart(16, "0")}-01`,
  tracestate: "host=ts",
});

/** One step of an agent: its own state and its export intent, in one transaction. */
async function writeStep(client: pg.PoolClient, run: string, branch: string, step: number) {
  await inTransaction(client, async () => {
    await client.query("UPDATE ts_host_state SET step = $3 WHERE tenant = $1 AND run = $2", [
      tenant, run, step,
    ]);
    await client.query(`SELECT ${fn("relay_append")}($1, $2, $3, $4, $5, p_meta => $6::jsonb)`, [
      tenant, run, branch, step, payload(run, branch, step),
      JSON.stringify(metadata(run, branch, step)),
    ]);
  });
}

async function main() {
  const pool = new pg.Pool({ connectionString: setting("DATABASE_URL"), max: 2 });
  const client = await pool.connect();
  try {
    await client.query(`CREATE TABLE IF NOT EXISTS ts_host_state (
        tenant text, run text, branch text, step bigint, PRIMARY KEY (tenant, run))`);
    const runIds = Array.from({ length: runs }, (_, i) => `ts-r${i + 1}`);
    for (const run of runIds) {
      await inTransaction(client, async () => {
        await client.query("INSERT INTO ts_host_state VALUES ($1, $2, 'main', 0)", [tenant, run]);
        await client.query(`SELECT ${fn("relay_open_run")}($1, $2, 'main')`, [tenant, run]);
      });
    }
    // Interleave the runs step by step, as concurrent agents would.
    for (let step = 1; step <= steps; step++) {
      for (const run of runIds) {
        await writeStep(client, run, "main", step);
      }
    }
    for (const run of runIds) {
      // The rewind: the host's state goes back to the fork, in the same transaction.
      const abandoned = await inTransaction(client, async () => {
        await client.query(
          "UPDATE ts_host_state SET branch = 'retry', step = $3 WHERE tenant = $1 AND run = $2",
          [tenant, run, fork],
        );
        const result = await client.query(
          `SELECT ${fn("relay_rewind")}($1, $2, 'main', $3, 'retry') AS abandoned`,
          [tenant, run, fork],
        );
        return Number(result.rows[0].abandoned);
      });
      console.log(JSON.stringify({ rewound: run, fork, abandoned }));
    }
    for (let step = fork + 1; step <= fork + retrySteps; step++) {
      for (const run of runIds) {
        await writeStep(client, run, "retry", step);
      }
    }
    // A refusal, handled: the old branch was abandoned by the rewind (SQLSTATE RL105). Inside
    // a savepoint, the host's transaction goes on; without one it would be aborted, so state
    // written beside a refused intent can never commit without it.
    const refused = await inTransaction(client, async () => {
      await client.query("SAVEPOINT intent");
      try {
        await client.query(`SELECT ${fn("relay_append")}($1, $2, 'main', $3, $4)`, [
          tenant, runIds[0], steps + 1, payload(runIds[0], "main", steps + 1),
        ]);
        return "accepted";
      } catch (error) {
        await client.query("ROLLBACK TO SAVEPOINT intent");
        const { code, message } = error as { code?: string; message: string };
        return `${code}: ${message}`;
      }
    });
    console.log(JSON.stringify({ refused }));
    // The runs end: later appends are refused (RL110) and consumers get an end marker after
    // each run's last intent.
    for (const run of runIds) {
      const closed = await inTransaction(client, async () => {
        const result = await client.query(
          `SELECT branch_id, end_lsn FROM ${fn("relay_close_run")}($1, $2)`,
          [tenant, run],
        );
        return result.rows[0] as { branch_id: string; end_lsn: string };
      });
      console.log(JSON.stringify({ closed: run, branch: closed.branch_id, end: Number(closed.end_lsn) }));
    }
  } finally {
    client.release();
    await pool.end();
  }
}

main().catch((error) => {
  const { code, message } = error as { code?: string; message: string };
  console.error(`host failed: ${code ?? ""} ${message}`);
  process.exit(1);
});
