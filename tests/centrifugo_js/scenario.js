// centrifuge-js (the JSON build, or the Protobuf one with --protobuf) against the gateway's
// /connection/websocket, for tests/gateway/test_centrifugo_js.py. Usage:
//   node scenario.js SCENARIO HTTP_URL ADMIN_KEY TOKEN CHANNEL [--protobuf]
// Prints one JSON object: what the SDK saw. Publications come from the server API (POST /api/publish);
// a transport drop is a relay of this script's cutting its connections.
'use strict';
const WebSocket = require('ws');
const { sdk, num, sleep, publisher, until, relay, report } = require('./common');

const [scenario, httpUrl, adminKey, token, channel, mode] = process.argv.slice(2);
const protobuf = mode === '--protobuf';
const { Centrifuge, encode, decode } = sdk(protobuf);
const publish = publisher(httpUrl, adminKey, channel);

function client(url, options = {}) {
  const c = new Centrifuge(url, { websocket: WebSocket, minReconnectDelay: 50, maxReconnectDelay: 500, ...options });
  const seen = { connecting: 0, connected: 0, disconnected: [] };
  c.on('connecting', () => { seen.connecting += 1; });
  c.on('connected', () => { seen.connected += 1; });
  c.on('disconnected', (ctx) => { seen.disconnected.push(ctx.code); });
  return { c, seen };
}

function subscription(c, name, options = {}) {
  const sub = c.newSubscription(name, options);
  const seen = { publications: [], subscribed: [], unsubscribed: [], joins: [], leaves: [] };
  sub.on('publication', (ctx) => seen.publications.push([num(ctx.offset), decode(ctx.data)]));
  sub.on('subscribed', (ctx) => seen.subscribed.push({ recovered: ctx.recovered, wasRecovering: ctx.wasRecovering }));
  sub.on('unsubscribed', (ctx) => seen.unsubscribed.push(ctx.code));
  sub.on('join', (ctx) => seen.joins.push(ctx.info.client));
  sub.on('leave', (ctx) => seen.leaves.push(ctx.info.client));
  return { sub, seen };
}

function wsUrl(port) {
  return `ws://127.0.0.1:${port}/connection/websocket`;
}

async function basic() {
  const port = new URL(httpUrl).port;
  const { c } = client(wsUrl(port), { token });
  const { sub, seen } = subscription(c, channel, { recoverable: true, positioned: true });
  const refused = subscription(c, `locked.${channel}`);
  sub.subscribe();
  refused.sub.subscribe();
  c.connect();  // connect and the subscribes go in one frame
  await until(() => seen.subscribed.length === 1 && refused.seen.unsubscribed.length === 1, 'subscribe answers');
  const offsets = [];
  for (let n = 0; n < 3; n += 1) offsets.push(await publish({ n }));
  await c.publish(channel, encode({ n: 'mine' }));
  await until(() => seen.publications.length === 4, 'publications');
  const rpc = await c.rpc('echo', encode({ a: 1 }));
  const history = await c.history(channel, { limit: -1 });
  const presence = await c.presence(channel);
  let denied = null;
  try {
    await c.publish(`locked.${channel}`, encode(1));
  } catch (err) {
    denied = err.code;
  }
  c.disconnect();
  return {
    offsets, publications: seen.publications, lockedUnsubscribed: refused.seen.unsubscribed, rpc: decode(rpc.data),
    history: history.publications.map((p) => [num(p.offset), decode(p.data)]), historyOffset: num(history.offset),
    presence: Object.keys(presence.clients).length, denied,
  };
}

async function badToken() {
  const port = new URL(httpUrl).port;
  const { c, seen } = client(wsUrl(port), { token });
  c.connect();
  await until(() => seen.disconnected.length > 0, 'disconnected');
  await sleep(1000);  // a reconnect loop would show meanwhile
  c.disconnect();
  return seen;
}

async function recovery() {
  const proxy = relay(new URL(httpUrl).port);
  const { c, seen: conn } = client(wsUrl(await proxy.listen()));
  const { sub, seen } = subscription(c, channel, { recoverable: true });
  sub.subscribe();
  c.connect();
  await until(() => seen.subscribed.length === 1, 'subscribed');
  for (let n = 0; n < 2; n += 1) await publish(n);
  await until(() => seen.publications.length === 2, '2 publications');
  proxy.cut();
  await until(() => conn.connecting >= 2, 'reconnecting');
  for (let n = 2; n < 5; n += 1) await publish(n);
  proxy.restore();
  await until(() => seen.subscribed.length === 2 && seen.publications.length === 5, 'recovered');
  proxy.cut();
  await until(() => conn.connecting >= 3, 'reconnecting again');
  for (let n = 5; n < 17; n += 1) await publish(n);  // more than the ring of 8 holds
  proxy.restore();
  await until(() => seen.subscribed.length === 3, 'subscribed a third time');
  await publish(17);
  await until(() => seen.publications.length >= 6, 'a live publication');
  await sleep(300);
  c.disconnect();
  proxy.close();
  return seen;
}

const scenarios = { basic, badToken, recovery };
report(scenarios[scenario]());
