/* seed_frame.c - writes one valid framed envelope of each kind into DIR, the
 * starting corpus for fuzz_frame (first byte: the chunk-size selector). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/rpc.h"

static void put(const char *dir, const char *name, const Meshrun__Envelope *env) {
  uint8_t *frame;
  size_t len;
  if (mr_rpc_encode(env, &frame, &len) != 0)
    exit(1);
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "wb");
  if (f == NULL)
    exit(1);
  fputc(3, f);
  fwrite(frame, 1, len, f);
  fwrite(frame, 1, len, f); /* two frames back to back */
  fclose(f);
  free(frame);
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: seed_frame DIR\n");
    return 2;
  }
  uint8_t nonce[32] = {1, 2, 3};
  Meshrun__Envelope env = MESHRUN__ENVELOPE__INIT;

  Meshrun__AuthChallenge ch = MESHRUN__AUTH_CHALLENGE__INIT;
  ch.nonce.data = nonce;
  ch.nonce.len = 32;
  env.msg_case = MESHRUN__ENVELOPE__MSG_AUTH_CHALLENGE;
  env.auth_challenge = &ch;
  put(argv[1], "challenge", &env);

  Meshrun__AuthResponse resp = MESHRUN__AUTH_RESPONSE__INIT;
  resp.nonce = ch.nonce;
  resp.mac = ch.nonce;
  env.msg_case = MESHRUN__ENVELOPE__MSG_AUTH_RESPONSE;
  env.auth_response = &resp;
  put(argv[1], "response", &env);

  Meshrun__Device dev = MESHRUN__DEVICE__INIT;
  dev.kind = "cpu";
  dev.name = "core0";
  Meshrun__Device *devs[] = {&dev};
  Meshrun__Hello hello = MESHRUN__HELLO__INIT;
  hello.protocol_version = MR_PROTOCOL_VERSION;
  hello.host = "node0";
  hello.pid = 77;
  hello.n_devices = 1;
  hello.devices = devs;
  env.msg_case = MESHRUN__ENVELOPE__MSG_HELLO;
  env.hello = &hello;
  put(argv[1], "hello", &env);

  int32_t shape[] = {2, 2};
  char *names[] = {"data", "model"};
  Meshrun__Mesh mesh = MESHRUN__MESH__INIT;
  mesh.n_shape = 2;
  mesh.shape = shape;
  mesh.n_dim_names = 2;
  mesh.dim_names = names;
  Meshrun__Welcome w = MESHRUN__WELCOME__INIT;
  w.rank = 1;
  w.world_size = 4;
  w.mesh = &mesh;
  w.job_id = "abc";
  env.msg_case = MESHRUN__ENVELOPE__MSG_WELCOME;
  env.welcome = &w;
  put(argv[1], "welcome", &env);

  Meshrun__Heartbeat hb = MESHRUN__HEARTBEAT__INIT;
  hb.step = 41;
  hb.last_done = 812;
  hb.waiting_on = 813;
  env.msg_case = MESHRUN__ENVELOPE__MSG_HEARTBEAT;
  env.heartbeat = &hb;
  put(argv[1], "heartbeat", &env);

  Meshrun__Report__Error err = MESHRUN__REPORT__ERROR__INIT;
  err.code = -3;
  err.message = "disk full";
  Meshrun__Report rep = MESHRUN__REPORT__INIT;
  rep.what_case = MESHRUN__REPORT__WHAT_ERROR;
  rep.error = &err;
  env.msg_case = MESHRUN__ENVELOPE__MSG_REPORT;
  env.report = &rep;
  put(argv[1], "report", &env);

  Meshrun__Rendezvous rv = MESHRUN__RENDEZVOUS__INIT;
  rv.key = "comm/0";
  rv.blob = ch.nonce;
  env.msg_case = MESHRUN__ENVELOPE__MSG_RENDEZVOUS;
  env.rendezvous = &rv;
  put(argv[1], "rendezvous", &env);
  return 0;
}
