// centrifuge-js (JSON or Protobuf build) with a server-side subscription made by the connect hook, for
// tests/gateway/test_centrifugo_server_subs.py. Usage:
//   node server_subs.js HTTP_URL ADMIN_KEY CHANNEL json|protobuf
// The client connects through a relay this script cuts (a transport drop) twice: 5 publications missed, all
// in the ring (recovered from the position sent in `connect` `subs`), then 12, more than the ring of 8 holds
// (`recovered: false`). Prints what the SDK saw of the subscription: one JSON object.
'use strict';
const WebSocket = require('ws');
const { sdk, num, sleep, publisher, until, relay, report } = require('./common');

const [httpUrl, adminKey, channel, mode] = process.argv.slice(2);
const protobuf = mode === 'protobuf';
const { Centrifuge, decode } = sdk(protobuf);
const publish = publisher(httpUrl, adminKey, channel);

async function main() {
  const proxy = relay(new URL(httpUrl).port);
  const port = await proxy.listen();
  const c = new Centrifuge(`ws://127.0.0.1:${port}/connection/websocket`,
    { websocket: WebSocket, minReconnectDelay: 50, maxReconnectDelay: 500 });
  const seen = { subscribed: [], publications: [], unsubscribed: 0 };
  let connecting = 0;
  c.on('connecting', () => { connecting += 1; });
  c.on('subscribed', (ctx) => {
    if (ctx.channel === channel) seen.subscribed.push({ recovered: ctx.recovered, wasRecovering: ctx.wasRecovering });
  });
  c.on('unsubscribed', () => { seen.unsubscribed += 1; });
  c.on('publication', (ctx) => {
    if (ctx.channel === channel) seen.publications.push([num(ctx.offset), decode(ctx.data)]);
  });
  c.connect();
  await until(() => seen.subscribed.length === 1, 'subscribed');
  for (let n = 0; n < 2; n += 1) await publish(n);
  await until(() => seen.publications.length === 2, '2 publications');
  proxy.cut();
  await until(() => connecting >= 2, 'reconnecting');
  for (let n = 2; n < 7; n += 1) await publish(n);
  proxy.restore();
  await until(() => seen.subscribed.length === 2 && seen.publications.length === 7, 'recovered');
  await sleep(300);
  proxy.cut();
  await until(() => connecting >= 3, 'reconnecting again');
  for (let n = 7; n < 19; n += 1) await publish(n);  // more than the ring of 8 holds
  proxy.restore();
  await until(() => seen.subscribed.length === 3, 'subscribed a third time');
  await publish(19);
  await until(() => seen.publications.length >= 8, 'a live publication');
  await sleep(300);
  c.disconnect();
  proxy.close();
  return seen;
}

report(main());
