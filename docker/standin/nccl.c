/* libnccl.so.2 for the stand-in base (docker/standin): answers ncclGetVersion with NCCL_CODE (2.32.3 unless
   built with -DNCCL_CODE=...), the version docker/pins.py checks; nothing else. */
#ifndef NCCL_CODE
#define NCCL_CODE 23203
#endif
int ncclGetVersion(int *version) {
  *version = NCCL_CODE;
  return 0;
}
