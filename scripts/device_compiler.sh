# Sourced by scripts/device_run.sh and scripts/ab_run.sh: build _C with the compiler that matches
# the libstdc++ Python loads (the image's default g++ is newer than it, and inlined iostream code
# then crashes against the older runtime's locale)
if [ -x /usr/bin/g++ ]; then
    export CC=/usr/bin/gcc CXX=/usr/bin/g++ LDSHARED="/usr/bin/g++ -shared"
else
    export DG_STATIC_LIBSTDCXX=1
fi
