// The timed part shared by pf.c and pfl.c: a cold prefill of n synthetic ids (1000 + 7919 i mod 100000) in
// 512-token llama_decode calls, logits for the last token only, as bench/engine_gap.py's engine_prefill does.
// Returns the seconds it took, or -1 when llama_decode fails.
#include <time.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static double prefill(struct llama_context*c, llama_batch b, int n){
  double t0=now();
  for(int pos=0;pos<n;pos+=512){
    int e=pos+512<n?pos+512:n; b.n_tokens=e-pos;
    for(int i=0;i<b.n_tokens;i++){b.token[i]=1000+((pos+i)*7919)%100000;b.pos[i]=pos+i;b.n_seq_id[i]=1;b.seq_id[i][0]=0;b.logits[i]=0;}
    if(e==n)b.logits[b.n_tokens-1]=1;
    if(llama_decode(c,b))return -1;
  }
  return now()-t0;
}
