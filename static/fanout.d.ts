// Types of static/fanout.js (docs/client.md), written by hand: the module itself has no build step.

export type TransportName = "ws" | "sse" | "lp";
export type ClientState = "connecting" | "connected" | "disconnected" | "closed";
export type TopicKind = "ring" | "snapshot" | "private";

export declare const DEFAULT_TRANSPORTS: readonly TransportName[];

export interface ConnectOptions {
  /** A JWT: `?token=` on /ws and /sse, `Authorization: Bearer` on POST /lp. */
  token?: string;
  /**
   * Gives a (fresh) token: before the first connection when `token` is not given, when the token expires
   * (mid-connection: sent with `auth`; close 4011: used by the reconnect) and on close 4001 (a different
   * token reconnects; the same one, or none, closes the client).
   */
  getToken?: () => string | null | Promise<string | null>;
  /** The transports to try, in this order. Default `["ws", "sse", "lp"]`. */
  transports?: TransportName[];
  /** A `ping` command this often while connected; 0: none. Default 20000. */
  pingIntervalMs?: number;
  /** No reply to a ping within this: the connection is dropped and re-made. Default 10000. */
  pingTimeoutMs?: number;
  /** A transport that has not opened within this has failed (the next one is tried). Default 10000. */
  connectTimeoutMs?: number;
  /** Cap of the first reconnect delay; doubles per failed attempt. Default 500. */
  backoffBaseMs?: number;
  /** Largest cap of a reconnect delay; a delay is uniform in [0, cap). Default 15000. */
  backoffMaxMs?: number;
  /** publish / rpc promises reject with `timeout` after this. Default 10000. */
  requestTimeoutMs?: number;
  /** Requests that may wait for a connection; beyond: reject with `queue_full`. Default 1000. */
  maxQueued?: number;
  /** After this long on a fallback transport, the next reconnect tries the better ones again. Default 60000. */
  upgradeAfterMs?: number;
}

export interface Position {
  epoch: string;
  /** The next seq wanted. */
  seq: number;
}

export interface Message {
  topic: string;
  seq: number;
  data: unknown;
  epoch: string;
}

export interface Loss {
  topic: string;
  /** First seq missed. */
  from: number;
  /** End of the missed range (exclusive); null for `epoch`: the stream restarted in a new epoch. */
  to: number | null;
  /** `gap`: a hole the gateway did not announce, seen by the library (should not happen; told, not hidden). */
  reason: "lagged" | "skipped" | "gone" | "epoch" | "gap";
  /** The epoch the stream continues in. */
  epoch: string;
}

export interface SubscribedInfo {
  topic: string;
  kind: TopicKind;
  epoch: string;
  /** Where the stream (re)starts, as the gateway said. */
  seq: number;
  /** Subscribed with a recovery point (a reconnect, or `since`). */
  resumed: boolean;
  transport: TransportName;
}

export type SubscriptionCloseReason = "unsubscribed" | "deleted" | "taken_over" | "lost" | "error" | "client_closed";

export interface CloseDetail {
  code?: number;
  reason?: string;
}

export declare class FanoutError extends Error {
  constructor(code: string, message: string, extra?: { closeCode?: number });
  /**
   * `timeout`, `disconnected` (lost after sending: it may have run), `queue_full`, `closed` (the client's end),
   * `token` (getToken failed), `transport` (a transport could not be created), or a gateway error code
   * (docs/protocol.md).
   */
  readonly code: string;
  /** The close code, when the error is the client's end. */
  readonly closeCode: number | undefined;
}

export declare class Subscription {
  readonly client: Client;
  readonly topic: string;
  /** Known from the first `subscribed`. */
  readonly kind: TopicKind | null;
  readonly epoch: string | null;
  /** The next seq this subscription needs. */
  readonly nextSeq: number | null;
  readonly state: "subscribing" | "subscribed" | "closed";
  /** Pass as `since` to a later `subscribe` (e.g. after a page reload) to resume exactly. */
  readonly position: Position | null;
  /** Whether the gateway sends this subscription deltas (asked with `delta: "fossil"`); null: not asked. */
  readonly deltaGranted: boolean | null;
  /** Messages rebuilt from a delta, and deltas that did not apply (a resubscribe with `since` follows, after a backoff). */
  readonly deltasApplied: number;
  readonly deltaFailures: number;
  on(event: "message", handler: (message: Message) => void): () => void;
  on(event: "loss", handler: (loss: Loss) => void): () => void;
  on(event: "subscribed", handler: (info: SubscribedInfo) => void): () => void;
  on(event: "error", handler: (error: FanoutError) => void): () => void;
  on(event: "closed", handler: (info: { reason: SubscriptionCloseReason }) => void): () => void;
  off(event: string, handler: (...args: any[]) => void): void;
  unsubscribe(): void;
}

export declare class Client {
  constructor(url?: string | URL, options?: ConnectOptions);
  /** The gateway's base URL, without a trailing slash. */
  readonly url: string;
  /** The transports tried, in order (the option, less those this browser lacks). */
  readonly transports: TransportName[];
  readonly state: ClientState;
  /** The current connection's transport; null while not connected. */
  readonly transport: TransportName | null;
  /** The gateway's id of the current connection (SSE, long-poll; null on WebSocket: ask `rpc("whoami")`). */
  readonly clientId: string | null;
  /** Connections made after the first. */
  readonly reconnects: number;
  /** The token the next connection uses. */
  readonly token: string | null;
  readonly subscriptions: ReadonlyMap<string, Subscription>;
  on(event: "state", handler: (state: ClientState, detail: CloseDetail) => void): () => void;
  on(event: "transport", handler: (name: TransportName) => void): () => void;
  on(event: "error", handler: (error: FanoutError) => void): () => void;
  /** A refreshed token was accepted (`auth` reply). */
  on(event: "auth", handler: (result: { user: string; expires_at: number }) => void): () => void;
  off(event: string, handler: (...args: any[]) => void): void;
  /** One subscription per topic: while one is open, the same one is returned. */
  subscribe(topic: string, options?: { since?: Position; delta?: "fossil" }): Subscription;
  publish(topic: string, data: unknown): Promise<{ seq: number }>;
  /** Methods: `echo`, `time`, `topics`, `whoami`. */
  rpc(method: "whoami"): Promise<{ client_id: string; transport: "ws" | "sse" | "longpoll"; user: string | null }>;
  rpc(method: "topics"): Promise<{ name: string; kind: TopicKind; epoch: string }[]>;
  rpc(method: "time"): Promise<number>;
  rpc(method: string, params?: unknown): Promise<unknown>;
  close(): void;
}

/** Connect to a gateway (its base http(s) URL; /ws, /sse and /lp are derived). Returns at once. */
export declare function connect(url?: string | URL, options?: ConnectOptions): Client;
