// fanout.js: the browser client of fanout-gateway (docs/client.md). One ES module, no dependency, no build.
//
//   import { connect } from "/fanout.js";
//   const client = connect("https://gw.example.com", { getToken: () => fetch("/token").then((r) => r.text()) });
//   const sub = client.subscribe("prices.eurusd");
//   sub.on("message", (m) => render(m.data));
//   sub.on("loss", (l) => refetch(l));     // the only way a message can be missed: told, with its range
//
// Transports, in the order tried: WebSocket (/ws), Server-Sent Events (/sse + POST /sse/SID), HTTP long-poll
// (/lp). All three carry the same entries (docs/protocol.md); this module turns them into the same events.
// Recovery is exact: every subscription is restored with `since` = its epoch and the next seq it needs, msgs
// below that seq are dropped (redelivery), and what cannot be recovered arrives as one `loss` event.

/** @typedef {"ws" | "sse" | "lp"} TransportName */
/** @typedef {"connecting" | "connected" | "disconnected" | "closed"} ClientState */

/**
 * @typedef {object} ConnectOptions
 * @property {string} [token] a JWT (docs/security.md); sent as `?token=` (WebSocket, SSE) or `Authorization: Bearer` (long-poll)
 * @property {() => (string | null | Promise<string | null>)} [getToken] called for a token before the first
 *   connection when `token` is not given, when the token expires (mid-connection: sent with `auth`; close 4011:
 *   on reconnect) and on close 4001 (a different token reconnects, the same or none closes the client)
 * @property {TransportName[]} [transports] the transports to try, in order (default `["ws", "sse", "lp"]`)
 * @property {number} [pingIntervalMs] a `ping` command every this many ms while connected (default 20000; 0: none)
 * @property {number} [pingTimeoutMs] no reply to a ping within this: the connection is dropped and re-made (default 10000)
 * @property {number} [connectTimeoutMs] a transport that has not opened within this has failed (default 10000)
 * @property {number} [backoffBaseMs] first reconnect delay cap (default 500)
 * @property {number} [backoffMaxMs] reconnect delay cap (default 15000); a delay is uniform in [0, cap)
 * @property {number} [requestTimeoutMs] publish / rpc promises reject with `timeout` after this (default 10000)
 * @property {number} [maxQueued] requests waiting for a connection at most (default 1000; more: `queue_full`)
 * @property {number} [upgradeAfterMs] after this long on a fallback transport, the next reconnect tries the
 *   better ones again (default 60000)
 */

/**
 * @typedef {object} Message
 * @property {string} topic
 * @property {number} seq
 * @property {unknown} data
 * @property {string} epoch
 */

/**
 * @typedef {object} Loss
 * @property {string} topic
 * @property {number} from first seq missed
 * @property {number | null} to end of the range (exclusive); null for `epoch`: the stream restarted
 * @property {"lagged" | "skipped" | "gone" | "epoch" | "gap"} reason `gap`: seen by this library, not announced
 *   by the gateway (should not happen; reported rather than hidden)
 * @property {string} epoch the epoch the stream continues in
 */

/**
 * @typedef {object} SubscribedInfo
 * @property {string} topic
 * @property {"ring" | "snapshot" | "private"} kind
 * @property {string} epoch
 * @property {number} seq where the stream (re)starts, as the gateway said
 * @property {boolean} resumed subscribed with a recovery point (a reconnect, or `since`)
 * @property {TransportName} transport
 */

import { DeltaBase, DeltaError } from "./fossil.js";

export const DEFAULT_TRANSPORTS = Object.freeze(["ws", "sse", "lp"]);

const DEFAULTS = {
  pingIntervalMs: 20000,
  pingTimeoutMs: 10000,
  connectTimeoutMs: 10000,
  backoffBaseMs: 500,
  backoffMaxMs: 15000,
  requestTimeoutMs: 10000,
  maxQueued: 1000,
  upgradeAfterMs: 60000,
};

/** commands per frame / POST body (docs/protocol.md: at most 100) */
const MAX_COMMANDS = 100;
/** failed opens of the transport that last worked before the whole list is tried again */
const STICKY_FAILURES = 3;
/** a connection that lived this long resets the backoff: the next reconnect is quick */
const STABLE_MS = 10000;
/** close codes after which the client does not reconnect (4001 and 4011 depend on getToken) */
const TERMINAL = new Set([4000, 4006]);
/** close 1012 (service restart): a draining gateway says when to reconnect, each client its own delay */
const SERVICE_RESTART = 1012;

/**
 * The reconnect delay (ms) a draining gateway hinted: close 1012 with "restarting: reconnect in N ms" (the SSE
 * close event and the long-poll entry also carry N as `retry_ms`); null for any other close.
 */
export function restartHintMs(code, reason, retryMs) {
  if (code !== SERVICE_RESTART) return null;
  if (Number.isFinite(retryMs) && retryMs >= 0) return retryMs;
  const match = /reconnect in (\d{1,9}) ms/.exec(reason || "");
  return match ? Number(match[1]) : null;
}

/** An error of the gateway (its `code`: docs/protocol.md error codes) or of this library. */
export class FanoutError extends Error {
  /**
   * @param {string} code `timeout`, `disconnected`, `queue_full`, `closed` (the client is closed), `token`
   *   (getToken failed), `transport` (a transport could not be created), or a gateway error code
   * @param {string} message
   * @param {{closeCode?: number}} [extra]
   */
  constructor(code, message, extra = {}) {
    super(`${code}: ${message}`);
    this.name = "FanoutError";
    /** @type {string} */
    this.code = code;
    /** @type {number | undefined} close code, when the error is a close */
    this.closeCode = extra.closeCode;
  }
}

function report(error) {
  // an application handler threw: tell the console, never break the client's state machine
  if (typeof globalThis.reportError === "function") globalThis.reportError(error);
  else console.error(error);
}

class Emitter {
  constructor() {
    /** @type {Map<string, Set<Function>>} */
    this._handlers = new Map();
  }

  /** Adds a handler; returns a function that removes it. */
  on(event, handler) {
    if (!this._handlers.has(event)) this._handlers.set(event, new Set());
    this._handlers.get(event).add(handler);
    return () => this.off(event, handler);
  }

  off(event, handler) {
    this._handlers.get(event)?.delete(handler);
  }

  _emit(event, ...args) {
    for (const handler of [...(this._handlers.get(event) ?? [])]) {
      try {
        handler(...args);
      } catch (error) {
        report(error);
      }
    }
  }
}

// -- transports --------------------------------------------------------------------------------------------
// Each opens itself in its constructor and reports through three callbacks: open({clientId}), batch(entries),
// close({code, reason, opened}). `opened` tells whether the gateway answered as itself (a session, or a close
// with a code): a transport that did not is a failed attempt and the next transport is tried. After close()
// (ours) no callback comes. send(commands) takes at most MAX_COMMANDS commands.

/** Hand one batch (its JSON text) to the transport's owner; text that is not JSON ends the transport (1007). */
function passBatch(transport, text, what) {
  if (transport.dead) return;
  let entries;
  try {
    entries = JSON.parse(text);
  } catch {
    transport._end(1007, `${what} that is not JSON`);
    return;
  }
  transport.cb.batch(entries);
}

class WsTransport {
  constructor(base, token, cb) {
    const url = new URL(base + "/ws");
    url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
    if (token) url.searchParams.set("token", token);
    this.cb = cb;
    this.opened = false;
    this.dead = false;
    const ws = (this.ws = new WebSocket(url));
    ws.onopen = () => {
      if (this.dead) return;
      this.opened = true;
      cb.open({});
    };
    ws.onmessage = (event) => passBatch(this, event.data, "a frame");
    ws.onclose = (event) => this._end(event.code, event.reason);
  }

  _end(code, reason) {
    if (this.dead) return;
    this.dead = true;
    if (this.ws.readyState < 2) this.ws.close();
    this.cb.close({ code, reason, opened: this.opened });
  }

  send(commands) {
    if (!this.dead && this.ws.readyState === 1) this.ws.send(JSON.stringify(commands.length === 1 ? commands[0] : commands));
  }

  close() {
    this.dead = true;
    try {
      this.ws.close(1000);
    } catch {
      // already closed
    }
  }
}

/** Commands of SSE and long-poll: one POST at a time, so they run in the order sent. */
class CommandPoster {
  constructor(url, onGone) {
    this.url = url;
    this.onGone = onGone;
    this.queue = [];
    this.busy = false;
    this.dead = false;
  }

  send(commands) {
    this.queue.push(...commands);
    this._pump();
  }

  async _pump() {
    if (this.busy || this.dead || this.queue.length === 0) return;
    this.busy = true;
    const commands = this.queue.splice(0, MAX_COMMANDS);
    try {
      const response = await fetch(this.url, {
        method: "POST",
        body: JSON.stringify(commands),
        headers: { "Content-Type": "application/json" },
        cache: "no-store",
      });
      // 404: the session ended (expired, closed): the stream or the poll tells the same, whichever comes first
      if (response.status === 404) this.onGone(1006, "the session is gone");
      else if (!response.ok) this.onGone(1006, `POST answered ${response.status}`);
    } catch {
      this.onGone(1006, "command POST failed");
    }
    this.busy = false;
    this._pump();
  }
}

/**
 * What SSE and long-poll share: a session at `${base}/${path}/${secret}` that takes commands by POST and is
 * deleted by `close`. A subclass opens its stream or poll and says how to stop it (`_stop`).
 */
class SessionTransport {
  constructor(base, cb, path) {
    this.base = base;
    this.cb = cb;
    this.path = path;
    this.opened = false;
    this.dead = false;
    this.secret = null;
    this.poster = null;
  }

  /** The session is open: commands go to its URL from now on (returned). */
  _session(secret) {
    this.secret = secret;
    const sessionUrl = `${this.base}/${this.path}/${encodeURIComponent(secret)}`;
    this.poster = new CommandPoster(sessionUrl, (code, reason) => this._end(code, reason));
    return sessionUrl;
  }

  _end(code, reason, retryMs) {
    if (this.dead) return;
    this.dead = true;
    this._stop();
    if (this.poster) this.poster.dead = true;
    this.cb.close({ code, reason, opened: this.opened, retryMs });
  }

  send(commands) {
    if (!this.dead && this.poster) this.poster.send(commands);
  }

  close() {
    if (this.dead && !this.secret) return;
    this.dead = true;
    this._stop();
    if (this.poster) this.poster.dead = true;
    if (this.secret) {
      fetch(`${this.base}/${this.path}/${encodeURIComponent(this.secret)}`, { method: "DELETE", keepalive: true }).catch(() => {});
      this.secret = null;
    }
  }
}

class SseTransport extends SessionTransport {
  constructor(base, token, cb) {
    super(base, cb, "sse");
    // Subscriptions go as commands (POST), not in ?topics=: the same path as the other transports, with
    // request ids (errors are matched to their subscription) and for any topic name.
    const url = new URL(base + "/sse");
    url.searchParams.set("topics", "");
    if (token) url.searchParams.set("token", token);
    const es = (this.es = new EventSource(url));
    es.addEventListener("session", (event) => {
      if (this.dead) return;
      const info = JSON.parse(event.data);
      this._session(info.session);
      this.opened = true;
      cb.open({ clientId: info.client_id });
    });
    es.onmessage = (event) => passBatch(this, event.data, "an event");
    es.addEventListener("close", (event) => {
      // The gateway ended the stream (or refused it: 4001 / 4006 / 4011 at connect). EventSource would
      // reconnect by itself: closed here, the client decides.
      let info = { code: 1006, reason: "" };
      try {
        info = JSON.parse(event.data);
      } catch {
        // keep 1006
      }
      this.opened = true;
      this._end(info.code, info.reason, info.retry_ms);
    });
    es.onerror = () => this._end(1006, "event stream failed");
  }

  _stop() {
    this.es.close();
  }
}

class LpTransport extends SessionTransport {
  constructor(base, token, cb) {
    super(base, cb, "lp");
    this.abort = new AbortController();
    this._start(token);
  }

  async _start(token) {
    let response, body;
    try {
      response = await fetch(this.base + "/lp", {
        method: "POST",
        headers: token ? { Authorization: `Bearer ${token}` } : {},
        signal: this.abort.signal,
        cache: "no-store",
      });
      body = await response.json();
    } catch {
      return this._end(1006, "POST /lp failed");
    }
    if (this.dead) return;
    if (response.status === 401) {
      // the token was refused: the close code the WebSocket would have given
      this.opened = true;
      const code = body?.error?.code === "token_expired" ? 4011 : 4001;
      return this._end(code, body?.error?.message ?? "token refused");
    }
    if (response.status === 429 || response.status === 503) {
      this.opened = true; // the gateway is there, at its session limit: back off, do not fall back
      return this._end(1013, body?.error?.message ?? "too many sessions");
    }
    if (response.status !== 201 || typeof body?.session !== "string") {
      return this._end(1006, `POST /lp answered ${response.status}`);
    }
    const sessionUrl = this._session(body.session);
    this.opened = true;
    this.cb.open({ clientId: body.client_id });
    this._poll(sessionUrl);
  }

  async _poll(sessionUrl) {
    let ack = null;
    while (!this.dead) {
      let response, body;
      try {
        response = await fetch(ack === null ? sessionUrl : `${sessionUrl}?ack=${ack}`, {
          signal: this.abort.signal,
          cache: "no-store",
        });
        body = await response.json();
      } catch {
        return this._end(1006, "poll failed");
      }
      if (this.dead) return;
      if (!response.ok) return this._end(1006, `poll answered ${response.status}`);
      if (body.batch !== null) ack = body.batch; // acknowledged by the next poll, once handled
      let closing = null;
      const entries = [];
      for (const entry of body.entries) {
        if (entry.type === "error" && entry.code === "closed" && entry.close_code !== undefined) closing = entry;
        else entries.push(entry);
      }
      if (entries.length) this.cb.batch(entries);
      if (closing) return this._end(closing.close_code, closing.message, closing.retry_ms);
    }
  }

  _stop() {
    this.abort.abort();
  }
}

const TRANSPORTS = { ws: WsTransport, sse: SseTransport, lp: LpTransport };

function available(name) {
  if (name === "ws") return typeof WebSocket !== "undefined";
  if (name === "sse") return typeof EventSource !== "undefined" && typeof fetch !== "undefined";
  return typeof fetch !== "undefined";
}

// -- subscriptions -------------------------------------------------------------------------------------------

/**
 * One topic's stream. Events: `message` (Message), `loss` (Loss), `subscribed` (SubscribedInfo), `error`
 * (FanoutError: the subscribe was refused; `closed` follows), `closed` ({reason}: `unsubscribed`, `deleted`,
 * `taken_over`, `lost`, `error`, `client_closed`).
 */
export class Subscription extends Emitter {
  constructor(client, topic, since, delta = null) {
    super();
    /** @type {Client} */
    this.client = client;
    /** @type {string} */
    this.topic = topic;
    /** @type {"ring" | "snapshot" | "private" | null} known from the first `subscribed` */
    this.kind = null;
    /** @type {string | null} */
    this.epoch = since ? since.epoch : null;
    /** @type {number | null} the next seq this subscription needs */
    this.nextSeq = since ? since.seq : null;
    /** @type {"subscribing" | "subscribed" | "closed"} */
    this.state = "subscribing";
    /** whether this subscription acknowledges its private entries (made over ws or sse with `ack: true`) */
    this.acking = false;
    /** the highest seq this subscription (since its last `subscribed`) was handed: never acknowledged past it */
    this.receivedTop = -1;
    /** `delta: "fossil"`: the base the topic's deltas apply to (fossil.js) */
    this.deltaBase = delta === "fossil" ? new DeltaBase() : null;
    /** @type {boolean | null} whether the gateway sends deltas (its last `subscribed` said so); null: not asked */
    this.deltaGranted = null;
    /** messages rebuilt from a delta, and deltas that failed (a resubscribe with `since` follows, after a backoff) */
    this.deltasApplied = 0;
    this.deltaFailures = 0;
    /** failed deltas since the last message that applied: the exponent of the resubscribe's backoff */
    this._deltaRetries = 0;
    /** the resubscribe after a failed delta, waiting out that backoff (null: none waits) */
    this._deltaRetryTimer = null;
  }

  /** Where to resume: pass it as `since` to a later `subscribe` (another page load) for an exact recovery. */
  get position() {
    return this.epoch !== null && this.nextSeq !== null ? { epoch: this.epoch, seq: this.nextSeq } : null;
  }

  unsubscribe() {
    if (this.state === "closed") return;
    this.client._unsubscribe(this);
    this._end("unsubscribed");
  }

  _command(id) {
    const command = { op: "subscribe", topic: this.topic, id };
    if (this.position) command.since = this.position;
    // A private queue keeps its entries until acknowledged, so what a dying connection had in flight comes
    // again on the next one (the gateway ignores `ack` on other kinds). Long-poll acknowledges every batch
    // with its next poll already.
    this.acking = this.client.transport !== "lp";
    if (this.acking) command.ack = true;
    if (this.deltaBase) command.delta = "fossil";
    return command;
  }

  /** A message's data; on a delta subscription rebuilt from the base (throws DeltaError). */
  _dataOf(entry) {
    const base = this.deltaBase;
    if (!base || entry.delta === undefined) return entry.data;
    let data;
    if (entry.delta === true) {
      data = base.apply(entry.data);
      this.deltasApplied++;
    } else {
      if (typeof entry.data !== "string") throw new DeltaError("a whole message of a delta subscription holds its text");
      data = base.whole(entry.data);
    }
    this._deltaRetries = 0; // a message that applied: the next failure resubscribes quickly again
    return data;
  }

  _onSubscribed(entry) {
    const resumed = this.epoch !== null && this.nextSeq !== null;
    this.receivedTop = -1;
    if (entry.delta !== undefined) this.deltaGranted = entry.delta === true;
    this.deltaBase?.reset(); // the gateway sends the next message whole
    this.kind = entry.kind;
    this.state = "subscribed";
    if (!resumed || entry.epoch !== this.epoch) {
      // New, or another epoch (gateway restarted, topic re-created): the stream starts where the gateway says;
      // a ring topic tells the loss with a `loss` entry (`epoch`, `to` null) that follows.
      this.epoch = entry.epoch;
      this.nextSeq = entry.seq;
    } else if (entry.kind === "private") {
      // The same epoch is the same queue, taken over: the uncommitted entries come again (the seq check below
      // drops them); a start past ours means another connection of the user committed entries we never saw.
      // A new queue has a new epoch (the branch above). See docs/client.md.
      if (entry.seq > this.nextSeq) this._loss(this.nextSeq, entry.seq, "gone");
    }
    // Same epoch, ring or snapshot: the gateway replays from our seq, or sends a `loss` entry first.
    this._emit("subscribed", {
      topic: this.topic, kind: entry.kind, epoch: entry.epoch, seq: entry.seq, resumed,
      transport: this.client.transport,
    });
  }

  _onMsg(entry) {
    if (this.state !== "subscribed") return;
    if (this.acking && this.kind === "private") {
      // acknowledged once this turn is over: what the application was handed, redeliveries dropped included
      this.receivedTop = Math.max(this.receivedTop, entry.seq);
      this.client._ackLater(this);
    }
    let data;
    try {
      data = this._dataOf(entry);
    } catch (error) {
      if (!(error instanceof DeltaError)) throw error;
      // nothing is shown of it: subscribe again from its seq (after a backoff), and the gateway sends it whole
      this.deltaFailures++;
      this.deltaBase.reset();
      this.client._resubscribe(this);
      return;
    }
    if (this.nextSeq !== null) {
      if (entry.seq < this.nextSeq) return; // had it already: redelivery, or an older snapshot value
      if (entry.seq > this.nextSeq && this.kind !== "snapshot") this._loss(this.nextSeq, entry.seq, "gap");
    }
    this.nextSeq = entry.seq + 1;
    this._emit("message", { topic: this.topic, seq: entry.seq, data, epoch: this.epoch });
  }

  _onLoss(entry) {
    if (this.state !== "subscribed") return;
    if (entry.to !== null) {
      if (this.nextSeq !== null && entry.to <= this.nextSeq) return; // a range already behind us
      this.nextSeq = entry.to;
    }
    this._emit("loss", { topic: this.topic, from: entry.from, to: entry.to, reason: entry.reason, epoch: this.epoch });
  }

  _loss(from, to, reason) {
    this.nextSeq = to;
    this._emit("loss", { topic: this.topic, from, to, reason, epoch: this.epoch });
  }

  _end(reason) {
    if (this.state === "closed") return;
    clearTimeout(this._deltaRetryTimer);
    this._deltaRetryTimer = null;
    this.state = "closed";
    this._emit("closed", { reason });
  }
}

// -- the client ----------------------------------------------------------------------------------------------

/**
 * A connection to the gateway that outlives its transports. Events: `state` (ClientState, {code, reason} of
 * the close that caused a disconnected/closed), `transport` (TransportName, on each connection), `error`
 * (FanoutError).
 */
export class Client extends Emitter {
  /**
   * @param {string} url the gateway's base http(s) URL
   * @param {ConnectOptions} [options]
   */
  constructor(url, options = {}) {
    super();
    const base = new URL(url ?? "", globalThis.location?.href);
    /** @type {string} */
    this.url = base.href.replace(/[?#].*$/, "").replace(/\/+$/, "");
    this.options = { ...DEFAULTS, ...options };
    const order = options.transports ?? DEFAULT_TRANSPORTS;
    for (const name of order) {
      if (!(name in TRANSPORTS)) throw new TypeError(`unknown transport ${JSON.stringify(name)} (ws, sse, lp)`);
    }
    /** @type {TransportName[]} */
    this.transports = order.filter(available);
    if (this.transports.length === 0) throw new TypeError("none of the transports is available here");
    /** @type {string | null} */
    this.token = options.token ?? null;
    this._getToken = options.getToken ?? null;
    this._needToken = this.token === null && this._getToken !== null;
    /** @type {ClientState} */
    this.state = "connecting";
    /** @type {TransportName | null} the transport of the current connection */
    this.transport = null;
    /** @type {string | null} the gateway's name for the current connection */
    this.clientId = null;
    /** connections made after the first one */
    this.reconnects = 0;
    /** @type {Map<string, Subscription>} */
    this.subscriptions = new Map();
    this._conn = null;
    this._nextId = 1;
    /** id -> {kind, resolve, reject, timer, sub, sent} */
    this._pending = new Map();
    /** topic -> the id of its subscribe waiting for an answer: one per topic in `_pending` (`_sendSubscribe`) */
    this._subscribing = new Map();
    /** the id of the `auth` waiting for an answer (one at most) */
    this._authId = null;
    /** requests waiting for a connection, in order */
    this._outbox = [];
    this._wire = [];
    /** private subscriptions with entries to acknowledge at the end of this turn */
    this._acksDue = new Set();
    this._attempt = 0;
    this._probe = 0;
    this._sticky = null;
    this._stickySince = 0;
    this._stickyFails = 0;
    this._everConnected = false;
    this._openedAt = 0;
    this._retryTimer = null;
    this._connectTimer = null;
    this._pingTimer = null;
    this._refreshing = false;
    this._announced = false;
    queueMicrotask(() => this._connect()); // after the caller attached its handlers
  }

  /**
   * Subscribe to a topic (one subscription per topic: a second call returns the first while it is open).
   * @param {string} topic
   * @param {{since?: {epoch: string, seq: number}, delta?: "fossil"}} [options] recover from seq `since.seq`
   *   of `since.epoch`; `delta: "fossil"`: the gateway may send messages as deltas of the one before, where
   *   the topic allows (`deltaGranted`); they are applied and checked here, so the events are the same
   * @returns {Subscription}
   */
  subscribe(topic, options = {}) {
    if (this.state === "closed") throw new FanoutError("closed", "the client is closed");
    const existing = this.subscriptions.get(topic);
    if (existing && existing.state !== "closed") return existing;
    const sub = new Subscription(this, topic, options.since ?? null, options.delta ?? null);
    this.subscriptions.set(topic, sub);
    if (this.state === "connected") this._sendSubscribe(sub);
    return sub;
  }

  /**
   * Publish to a topic (one that takes client publishes). Resolves to `{seq}`.
   * @param {string} topic
   * @param {unknown} data
   * @returns {Promise<{seq: number}>}
   */
  publish(topic, data) {
    return this._request({ op: "publish", topic, data });
  }

  /**
   * Call an rpc method (`echo`, `time`, `topics`, `whoami`). Resolves to its result.
   * @param {string} method
   * @param {unknown} [params]
   * @returns {Promise<unknown>}
   */
  rpc(method, params = null) {
    return this._request({ op: "rpc", method, params });
  }

  /** Close for good: no reconnect; pending requests reject with `closed`; subscriptions close (`client_closed`). */
  close() {
    this._terminate(1000, "closed by the application", false);
  }

  // -- requests --------------------------------------------------------------------------------------------

  _request(command) {
    if (this.state === "closed") return Promise.reject(new FanoutError("closed", "the client is closed"));
    return new Promise((resolve, reject) => {
      const id = this._nextId++;
      command.id = id;
      const pending = { kind: "request", resolve, reject, sent: false, command, timer: null };
      pending.timer = setTimeout(() => {
        this._pending.delete(id);
        const waiting = this._outbox.indexOf(id);
        if (waiting >= 0) this._outbox.splice(waiting, 1);
        reject(new FanoutError("timeout", `no answer in ${this.options.requestTimeoutMs} ms`));
      }, this.options.requestTimeoutMs);
      if (this.state !== "connected" && this._outbox.length >= this.options.maxQueued) {
        clearTimeout(pending.timer);
        reject(new FanoutError("queue_full", `${this.options.maxQueued} requests already wait for a connection`));
        return;
      }
      this._pending.set(id, pending);
      if (this.state === "connected") {
        pending.sent = true;
        this._send(command);
      } else {
        this._outbox.push(id);
      }
    });
  }

  _settle(id) {
    const pending = this._pending.get(id);
    if (pending) {
      this._pending.delete(id);
      clearTimeout(pending.timer);
      if (pending.kind === "subscribe" && this._subscribing.get(pending.sub.topic) === id) {
        this._subscribing.delete(pending.sub.topic);
      }
      if (id === this._authId) this._authId = null;
    }
    return pending;
  }

  _send(command) {
    this._wire.push(command);
    if (this._wire.length === 1) queueMicrotask(() => this._flush()); // commands of one tick: one frame
  }

  _flush() {
    const commands = this._wire;
    this._wire = [];
    if (!this._conn || this.state !== "connected") return;
    for (let i = 0; i < commands.length; i += MAX_COMMANDS) this._conn.send(commands.slice(i, i + MAX_COMMANDS));
  }

  _ackLater(sub) {
    this._acksDue.add(sub);
    if (this._acksDue.size === 1) queueMicrotask(() => this._sendAcks());
  }

  _sendAcks() {
    const due = this._acksDue;
    this._acksDue = new Set();
    for (const sub of due) {
      // cumulative, never past what this subscription received nor what was handed to the application
      const seq = Math.min(sub.nextSeq - 1, sub.receivedTop);
      if (sub.state === "subscribed" && this.state === "connected" && seq >= 0) {
        this._send({ op: "ack", topic: sub.topic, seq });
      }
    }
  }

  /** A subscribe replaces the topic's one still waiting for an answer (a late answer to that one is then
   * ignored), so a gateway that answers none cannot grow `_pending`: one subscribe per topic at most. */
  _sendSubscribe(sub) {
    const id = this._nextId++;
    const older = this._subscribing.get(sub.topic);
    if (older !== undefined) this._pending.delete(older);
    this._subscribing.set(sub.topic, id);
    this._pending.set(id, { kind: "subscribe", sub, timer: null });
    this._send(sub._command(id));
  }

  /** A delta did not apply: unsubscribe, and subscribe again from the next seq `sub` needs after a delay of
   * full jitter, doubling from backoffBaseMs with each failure since the last message that applied, at most
   * backoffMaxMs. What comes for the topic meanwhile is ignored, so one resubscribe answers any number of
   * failures: a gateway answering each resubscribe with another bad delta meets a growing delay, not a loop. */
  _resubscribe(sub) {
    if (sub.state === "closed" || sub._deltaRetryTimer !== null) return;
    sub.state = "subscribing"; // what comes before the new `subscribed` is dropped
    if (this.state === "connected") this._send({ op: "unsubscribe", topic: sub.topic });
    const cap = Math.min(this.options.backoffMaxMs, this.options.backoffBaseMs * 2 ** Math.min(sub._deltaRetries, 30));
    sub._deltaRetries++;
    sub._deltaRetryTimer = setTimeout(() => {
      sub._deltaRetryTimer = null;
      // without a connection, the next one subscribes it
      if (sub.state !== "closed" && this.state === "connected") this._sendSubscribe(sub);
    }, Math.random() * cap);
  }

  _unsubscribe(sub) {
    if (this.subscriptions.get(sub.topic) === sub) this.subscriptions.delete(sub.topic);
    // a resubscribe waiting out its backoff has unsubscribed already
    if (this.state === "connected" && sub.state !== "closed" && sub._deltaRetryTimer === null) {
      this._send({ op: "unsubscribe", topic: sub.topic });
    }
  }

  // -- connection ------------------------------------------------------------------------------------------

  _setState(state, detail = {}) {
    if (this.state === state) return;
    this.state = state;
    this._emit("state", state, detail);
  }

  _chooseTransport() {
    if (this._sticky && this.transports.includes(this._sticky)) return this._sticky;
    return this.transports[this._probe % this.transports.length];
  }

  async _connect() {
    this._retryTimer = null;
    if (this.state === "closed") return;
    if (!this._announced) this._emit("state", "connecting", {}); // the constructor's state, once handlers are on
    this._announced = true;
    this._setState("connecting");
    if (this._needToken) {
      let token;
      try {
        token = await this._getToken();
      } catch (error) {
        this._emit("error", new FanoutError("token", `getToken failed: ${error}`));
        return this._retry();
      }
      if (this.state === "closed") return;
      this._needToken = false;
      if (token) this.token = token;
    }
    const name = this._chooseTransport();
    let conn;
    try {
      conn = new TRANSPORTS[name](this.url, this.token, {
        open: (info) => this._onOpen(conn, name, info),
        batch: (entries) => conn === this._conn && this._onBatch(entries),
        close: (event) => this._onClose(conn, event),
      });
    } catch (error) {
      // e.g. a WebSocket refused by the page's Content-Security-Policy: as if it had not opened
      this._emit("error", new FanoutError("transport", `${name}: ${error}`));
      return this._openFailed(1006, String(error));
    }
    this._conn = conn;
    this._connectTimer = setTimeout(() => {
      if (conn !== this._conn || this.state === "connected") return;
      conn.close();
      this._onClose(conn, { code: 1006, reason: "connect timeout", opened: false });
    }, this.options.connectTimeoutMs);
  }

  _onOpen(conn, name, info) {
    if (conn !== this._conn) return;
    clearTimeout(this._connectTimer);
    this._openedAt = Date.now();
    if (this._sticky !== name) {
      this._sticky = name;
      this._stickySince = this._openedAt;
    }
    this._stickyFails = 0;
    this._probe = 0;
    if (this._everConnected) this.reconnects++;
    this._everConnected = true;
    this.transport = name;
    this.clientId = info.clientId ?? null;
    this.state = "connected"; // announced below, once the subscriptions and the waiting requests are sent
    for (const sub of this.subscriptions.values()) {
      sub.state = "subscribing";
      if (sub._deltaRetryTimer === null) this._sendSubscribe(sub); // else its timer does
    }
    for (const id of this._outbox.splice(0)) {
      const pending = this._pending.get(id);
      if (!pending) continue;
      pending.sent = true;
      this._send(pending.command);
    }
    this._schedulePing(conn);
    this._emit("state", "connected", {});
    if (conn === this._conn) this._emit("transport", name);
  }

  _schedulePing(conn) {
    clearTimeout(this._pingTimer);
    if (!this.options.pingIntervalMs) return;
    this._pingTimer = setTimeout(() => {
      if (conn !== this._conn || this.state !== "connected") return;
      const id = this._nextId++;
      const timer = setTimeout(() => {
        this._pending.delete(id);
        if (conn !== this._conn) return;
        conn.close();
        this._onClose(conn, { code: 1006, reason: "no pong", opened: true });
      }, this.options.pingTimeoutMs);
      this._pending.set(id, { kind: "ping", timer, conn });
      this._send({ op: "ping", id });
    }, this.options.pingIntervalMs);
  }

  _onBatch(entries) {
    if (!Array.isArray(entries)) return;
    for (const entry of entries) {
      if (this._conn === null) return; // a handler closed the client
      const sub = entry.topic !== undefined ? this.subscriptions.get(entry.topic) : undefined;
      switch (entry.type) {
        case "msg":
          sub?._onMsg(entry);
          break;
        case "loss":
          sub?._onLoss(entry);
          break;
        case "subscribed": {
          // the subscription that asked (an earlier one of the same topic may have been replaced since); an
          // id not waiting: the answer to a subscribe replaced since (`_sendSubscribe`), or to none of ours
          const asked = this._settle(entry.id);
          if (!asked && entry.id !== undefined && entry.id !== null) break;
          const target = asked?.kind === "subscribe" ? asked.sub : sub;
          if (target && target === sub && sub.state !== "closed" && sub._deltaRetryTimer === null) sub._onSubscribed(entry);
          break;
        }
        case "unsubscribed":
          this._settle(entry.id);
          break;
        case "closed":
          if (sub) {
            this.subscriptions.delete(sub.topic);
            sub._end(entry.reason);
          }
          break;
        case "reply":
          this._onReply(entry);
          break;
        case "error":
          this._onError(entry);
          break;
        default:
          break; // a newer gateway's entry: ignored
      }
    }
  }

  _onReply(entry) {
    const pending = this._settle(entry.id);
    if (!pending) return;
    if (pending.kind === "ping") this._schedulePing(pending.conn);
    else if (pending.kind === "auth") this._emit("auth", entry.result);
    else if (pending.kind === "request") pending.resolve(entry.result);
  }

  _onError(entry) {
    const error = new FanoutError(entry.code, entry.message);
    const pending = entry.id !== undefined && entry.id !== null ? this._settle(entry.id) : undefined;
    if (pending?.kind === "request") return pending.reject(error);
    if (pending?.kind === "subscribe") {
      if (entry.code === "already_subscribed") return;
      const sub = pending.sub;
      if (this.subscriptions.get(sub.topic) === sub) this.subscriptions.delete(sub.topic);
      sub._emit("error", error);
      return sub._end("error");
    }
    if (pending?.kind === "ping") {
      this._schedulePing(pending.conn);
      return;
    }
    if (!pending && entry.code === "token_expired") {
      this._refreshToken();
      return;
    }
    this._emit("error", error);
  }

  async _refreshToken() {
    // the gateway closes with 4011 unless a fresh token comes with `auth` within auth.expired_grace_s
    if (!this._getToken) {
      this._emit("error", new FanoutError("token_expired", "the token expired and there is no getToken"));
      return;
    }
    if (this._refreshing) return;
    this._refreshing = true;
    try {
      const token = await this._getToken();
      if (!token) throw new Error("getToken gave no token");
      this.token = token;
      if (this.state === "connected") {
        const id = this._nextId++;
        if (this._authId !== null) this._pending.delete(this._authId); // one auth waits at most
        this._authId = id;
        this._pending.set(id, { kind: "auth", timer: null });
        this._send({ op: "auth", token, id });
      }
    } catch (error) {
      this._emit("error", new FanoutError("token_expired", `getToken failed: ${error}`));
    } finally {
      this._refreshing = false;
    }
  }

  _dropConnectionState() {
    clearTimeout(this._connectTimer);
    clearTimeout(this._pingTimer);
    this._wire = [];
    for (const [id, pending] of this._pending) {
      if (pending.kind === "request" && !pending.sent) continue; // still waits in the outbox
      this._pending.delete(id);
      clearTimeout(pending.timer);
      if (pending.kind === "request") {
        pending.reject(new FanoutError("disconnected", "the connection was lost before the answer (it may have run)"));
      }
    }
    this._subscribing.clear();
    this._authId = null;
    for (const sub of this.subscriptions.values()) if (sub.state === "subscribed") sub.state = "subscribing";
    this.transport = null;
    this.clientId = null;
  }

  async _onClose(conn, { code, reason, opened, retryMs }) {
    if (conn !== this._conn) return;
    this._conn = null;
    const lived = this._openedAt ? Date.now() - this._openedAt : 0;
    const wasOpen = this.state === "connected";
    this._openedAt = 0;
    this._dropConnectionState();
    if (this.state === "closed") return;
    if (!wasOpen && !opened) return this._openFailed(code, reason);
    if (lived >= STABLE_MS) this._attempt = 0;
    if (this._sticky && this._sticky !== this.transports[0] && Date.now() - this._stickySince >= this.options.upgradeAfterMs) {
      this._sticky = null; // been on a fallback long enough: try the better transports again
      this._probe = 0;
    }
    if (TERMINAL.has(code)) return this._terminate(code, reason, true);
    if (code === 4001 || code === 4011) {
      if (!this._getToken) return this._terminate(code, reason, true);
      this._setState("disconnected", { code, reason });
      const previous = this.token;
      let token;
      try {
        token = await this._getToken();
      } catch (error) {
        this._emit("error", new FanoutError("token", `getToken failed: ${error}`));
        return this._retry({ code, reason });
      }
      if (this.state === "closed") return;
      if (!token || (code === 4001 && token === previous)) return this._terminate(code, reason, true);
      this.token = token;
    }
    this._retry({ code, reason }, restartHintMs(code, reason, retryMs));
  }

  /** The transport tried could not reach the gateway: the next in the list at once; all failed: back off. */
  _openFailed(code, reason) {
    if (this._sticky) {
      if (++this._stickyFails >= STICKY_FAILURES) {
        this._sticky = null;
        this._probe = 0;
      }
      return this._retry({ code, reason });
    }
    this._probe++;
    if (this._probe < this.transports.length) return this._connect(); // still "connecting"
    this._probe = 0;
    return this._retry({ code, reason });
  }

  /** Back off: full jitter, growing with each attempt; after a drain's 1012 at least the delay the gateway hinted
   * (`hintMs`, at most backoffMaxMs). A hint never replaces the backoff: a gateway closing every connection
   * with "reconnect in 0 ms" still meets a growing delay. */
  _retry(detail = {}, hintMs = null) {
    if (this.state === "closed") return;
    this._setState("disconnected", detail);
    const cap = Math.min(this.options.backoffMaxMs, this.options.backoffBaseMs * 2 ** Math.min(this._attempt, 30));
    this._attempt++;
    let delay = Math.random() * cap; // full jitter
    if (hintMs !== null) delay = Math.min(this.options.backoffMaxMs, Math.max(hintMs, delay)); // the gateway spread its clients' reconnects
    clearTimeout(this._retryTimer);
    this._retryTimer = setTimeout(() => this._connect(), delay);
  }

  _terminate(code, reason, byGateway) {
    if (this.state === "closed") return;
    clearTimeout(this._retryTimer);
    const conn = this._conn;
    this._conn = null;
    if (conn) conn.close();
    this._dropConnectionState();
    this.state = "closed";
    const error = new FanoutError("closed", reason || `closed with ${code}`, { closeCode: code });
    for (const id of this._outbox.splice(0)) {
      const pending = this._settle(id);
      pending?.reject(error);
    }
    if (byGateway) this._emit("error", error);
    this._emit("state", "closed", { code, reason });
    for (const sub of [...this.subscriptions.values()]) sub._end("client_closed");
    this.subscriptions.clear();
  }
}

/**
 * Connect to a gateway. Returns at once; the client connects, and reconnects, by itself.
 * @param {string} url the gateway's base http(s) URL (e.g. `https://gw.example.com`); `/ws`, `/sse`, `/lp` are derived
 * @param {ConnectOptions} [options]
 * @returns {Client}
 */
export function connect(url, options) {
  return new Client(url, options);
}
