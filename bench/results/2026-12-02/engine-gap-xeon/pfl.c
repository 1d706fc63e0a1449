// long-lived: load once, then one cold prefill of N synthetic ids per line read on stdin; prints seconds per line
// As run: built like pf.c (gcc -O2 -o /tmp/x/pfl pfl.c ... -lggml-cpu -lggml-base), driven by proto.py; SPIN_MS=200 busy-waits before each timed prefill, SWA_FULL=0 and TP=1 (an attached ggml threadpool) set llama-server's own; see README.md.
#include "llama.h"
#include "prefill.h"
#include "ggml-cpu.h"
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
int main(int argc,char**argv){
  const char*path=argv[1]; int n=atoi(argv[2]);
  llama_backend_init();
  struct llama_model_params mp=llama_model_default_params(); mp.use_extra_bufts=false; mp.n_gpu_layers=0;
  struct llama_model*m=llama_model_load_from_file(path,mp);
  struct llama_context_params cp=llama_context_default_params();
  cp.n_ctx=n+64; cp.n_batch=512; cp.n_ubatch=512; cp.n_seq_max=1; cp.kv_unified=false; cp.n_threads=2; cp.n_threads_batch=2;
  cp.no_perf=true; cp.swa_full=getenv("SWA_FULL")?atoi(getenv("SWA_FULL")):1; cp.flash_attn_type=LLAMA_FLASH_ATTN_TYPE_DISABLED;
  struct llama_context*c=llama_init_from_model(m,cp);
  if(getenv("TP")){struct ggml_threadpool_params tpp=ggml_threadpool_params_default(2); struct ggml_threadpool*tp=ggml_threadpool_new(&tpp); llama_attach_threadpool(c,tp,NULL);}
  llama_batch b=llama_batch_init(512,0,1);
  char line[64];
  printf("ready\n"); fflush(stdout);
  while(fgets(line,sizeof line,stdin)){
    llama_memory_seq_rm(llama_get_memory(c),0,-1,-1);
    { double s=now(); double ms=getenv("SPIN_MS")?atof(getenv("SPIN_MS")):0; volatile double x=0; while(now()-s<ms/1000) x+=1; }
    double s=prefill(c,b,n);
    if(s<0){fprintf(stderr,"decode failed\n");return 1;}
    printf("%.3f\n",s); fflush(stdout);
  }
  return 0;
}
