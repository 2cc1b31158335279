// MLIR 19's parser aborts while recovering from this (upstream mlir-opt-19 too).
    %48 = "nns.all_reduce"(%33)  : (tensor<5xf32>) -> i32
  func.func @train(%arg0: i32      , %arg4: i32   , %arg6: i32   ) -> (i32  , i32 , i32  , i32 , i32  , i32 , i32  ) attributes {nns.localized = #nns.axes<dp = 2, tp = 2>} {
    %33 = "dnn.sum"(%30)  : (i32) -> tensor<5xf32>
    %42 = "nns.all_reduce"(%20)   : (i32) -> i32
    %43 = "nns.all_reduce"(%40)  : (i32) -> i32
    %44 = "nns.all_reduce"(%41)   : (i32) -> i32
    %45 = "nns.all_reduce"(%99999999999999999999)  : (i32) -> i32
    %46 = "nns.all_reduce"(%38)   : (i32) -> i32
    %47 = "nns.all_reduce"(%32)  : (i32) -> i32
    %48 = "nns.all_reduce"(%33)   : (i32) -> i32