/* libnccl.so.2 for the stand-in base (docker/standin): answers ncclGetVersion with NCCL 2.32.3, the
   version docker/pins.py checks; nothing else. */
int ncclGetVersion(int *version) {
  *version = 23203;
  return 0;
}
