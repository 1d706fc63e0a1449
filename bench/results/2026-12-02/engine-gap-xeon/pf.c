// prefill N synthetic token ids cold (prefill.h), REPS times in one fresh process, 1 s idle before each; prints seconds per rep
// Built and run from /tmp/x (commands as run): gcc -O2 -o /tmp/x/pf pf.c -I$S/include -I$S/ggml/include -Lbuild-shared/bin -lllama
//   -Wl,-rpath,$PWD/build-shared/bin  (in bench/.llama-server, S=llama_cpp_python-0.3.36/vendor/llama.cpp; build-shared: the
//   cmake build of README.md); usage: pf MODEL.gguf N_TOKENS REPS
#include "llama.h"
#include "prefill.h"
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
int main(int argc,char**argv){
  const char*path=argv[1]; int n=atoi(argv[2]); int reps=atoi(argv[3]);
  llama_backend_init();
  struct llama_model_params mp=llama_model_default_params(); mp.use_extra_bufts=false; mp.n_gpu_layers=0;
  struct llama_model*m=llama_model_load_from_file(path,mp);
  struct llama_context_params cp=llama_context_default_params();
  cp.n_ctx=n+64; cp.n_batch=512; cp.n_ubatch=512; cp.n_seq_max=1; cp.kv_unified=false; cp.n_threads=2; cp.n_threads_batch=2;
  cp.no_perf=true; cp.swa_full=getenv("SWA_FULL")?atoi(getenv("SWA_FULL")):true; cp.flash_attn_type=LLAMA_FLASH_ATTN_TYPE_DISABLED;
  struct llama_context*c=llama_init_from_model(m,cp);
  llama_batch b=llama_batch_init(512,0,1);
  for(int r=0;r<reps;r++){
    sleep(1);
    llama_memory_clear(llama_get_memory(c),true);
    double s=prefill(c,b,n);
    if(s<0){fprintf(stderr,"decode failed\n");return 1;}
    printf("%.3f\n",s); fflush(stdout);
  }
  return 0;
}
