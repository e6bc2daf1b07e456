import csv, io, collections, sys
def load(path):
    txt=open(path).read(); i=txt.index('"ID"')
    rows=list(csv.DictReader(io.StringIO(txt[i:])))
    nv=[k for k in rows[0] if k.startswith('thread Domain')][0]
    kern=collections.OrderedDict()
    for r in rows:
        d=kern.setdefault(r['ID'],{'_nvtx':r[nv],'_name':r['Kernel Name'],'_grid':r['Grid Size'],'_block':r['Block Size'],'m':{}})
        d['m'][r['Metric Name']]=(r['Metric Value'],r['Metric Unit'])
    return kern
want=['Duration','SM Frequency','Compute (SM) Throughput','L2 Cache Throughput','DRAM Throughput','Issue Slots Busy','Eligible Warps Per Scheduler','Warp Cycles Per Issued Instruction','L2 Hit Rate','Achieved Occupancy','sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active','l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum']
for path in sys.argv[1:]:
    for id_,d in load(path).items():
        print(id_, d['_nvtx'][-40:], d['_grid'], d['_block'])
        m=d['m']
        print('   ', '; '.join(f"{k.replace('sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active','gmma%').replace('l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum','smem_conflicts')}={m[k][0]}{m[k][1]}" for k in want if k in m))
        st={k.replace('smsp__average_warps_issue_stalled_','').replace('_per_issue_active.ratio',''):float(v[0]) for k,v in m.items() if k.startswith('smsp__average_warps_issue_stalled')}
        top=sorted(st.items(), key=lambda kv:-kv[1])[:6]
        print('    stalls:', ', '.join(f"{k}={v:.2f}" for k,v in top))
